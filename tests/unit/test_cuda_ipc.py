"""Same-host P2P through CUDA IPC (transfer/cuda_ipc.py) against a fake driver that models memory as bytes:
the source's allocations, their mappings in the target, the copies between them. What a GPU alone can show
(the driver's real calls, the speed) is in docs/benchmarks.md; here: offsets, mappings closed, the fallback
rules (nothing landed → NIXL; a failed copy → landed) and when the pull is chosen at all."""

from __future__ import annotations

import base64
import ctypes
import os
import types

import pytest

from mxlaunch.plugin import p2p, p2p_source
from mxlaunch.transfer import cuda_ipc, ipc_handoff
from mxlaunch.transfer.regions import Region
from mxlaunch.transfer.tensor_set import Pair

pytestmark = pytest.mark.unit


class FakeDriver:
    """A flat address space: allocations by base address; `open` maps one at a new address (a new view of the
    same bytes, like cuIpcOpenMemHandle); `copy` moves bytes between any two addresses it knows."""

    def __init__(self) -> None:
        self.allocs: dict[int, bytearray] = {}
        self.handles: dict[bytes, int] = {}
        self.mapped: dict[int, int] = {}  # mapping address → source allocation base
        self.closed: list[int] = []
        self.fail_open = self.fail_copy = False
        self.next_map = 0x9000_0000

    def on_device(self, ordinal: int) -> None:
        self.device = ordinal

    def alloc(self, base: int, data: bytes) -> None:
        self.allocs[base] = bytearray(data)

    def _locate(self, addr: int) -> tuple[bytearray, int]:
        for m, base in self.mapped.items():
            if m <= addr < m + len(self.allocs[base]):
                return self.allocs[base], addr - m
        for base, buf in self.allocs.items():
            if base <= addr < base + len(buf):
                return buf, addr - base
        raise OSError(f"address {addr:#x} is not mapped")

    def allocation(self, addr: int) -> tuple[int, int]:
        for base, buf in self.allocs.items():
            if base <= addr < base + len(buf):
                return base, len(buf)
        raise OSError("cuMemGetAddressRange returned CUresult 1")

    def export(self, addr: int) -> bytes:
        handle = addr.to_bytes(8, "little") * 8
        self.handles[handle] = addr
        return handle

    def open(self, handle: bytes) -> int:
        if self.fail_open:
            raise OSError("cuIpcOpenMemHandle returned CUresult 201")
        self.next_map += 0x1000_0000
        self.mapped[self.next_map] = self.handles[handle]
        return self.next_map

    def close(self, ptr: int) -> None:
        self.closed.append(ptr)
        self.mapped.pop(ptr)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if self.fail_copy:
            raise OSError("cuMemcpyDtoDAsync returned CUresult 700")
        sbuf, soff = self._locate(src)
        dbuf, doff = self._locate(dst)
        dbuf[doff:doff + nbytes] = sbuf[soff:soff + nbytes]

    def wait(self, stream: int) -> None:
        pass


def two_allocations(driver: FakeDriver) -> tuple[list[Region], list[Pair]]:
    """The source: two allocations of three tensors; the target: one allocation to fill."""
    driver.alloc(0x1000, bytes(range(256)) * 4)  # 1024 bytes
    driver.alloc(0x8000, bytes(reversed(range(256))) * 2)  # 512 bytes
    driver.alloc(0x50000, bytes(2048))  # the target's own memory
    regions = [Region(0x1000, 1024, 0, "cuda"), Region(0x8000, 512, 0, "cuda")]
    pairs = [Pair("a", 0x50000, 0x1000 + 100, 300, 0, 0, "cuda", "cuda"),
             Pair("b", 0x50000 + 300, 0x1000 + 700, 200, 0, 0, "cuda", "cuda"),
             Pair("c", 0x50000 + 600, 0x8000 + 12, 500, 0, 0, "cuda", "cuda")]
    return regions, pairs


def test_a_pull_copies_each_tensor_from_its_offset_in_the_mapped_allocation_and_closes_every_mapping() -> None:
    driver = FakeDriver()
    regions, pairs = two_allocations(driver)
    allocations, why = cuda_ipc.export_regions(regions, driver)
    assert why == "" and [a["addr"] for a in allocations] == [0x1000, 0x8000]
    stats = cuda_ipc.pull(allocations, pairs, stream=0, driver=driver)
    target, first, second = driver.allocs[0x50000], driver.allocs[0x1000], driver.allocs[0x8000]
    assert target[:300] == first[100:400] and target[300:500] == first[700:900] and target[600:1100] == second[12:512]
    assert stats.bytes == 1000 and stats.allocations == 2
    assert sorted(driver.closed) == sorted(set(driver.closed)) and len(driver.closed) == 2 and not driver.mapped


def test_a_region_inside_an_allocation_exports_the_allocation_once_and_pulls_from_its_offset() -> None:
    """vLLM's small weights share a caching-allocator segment whose first block is something else: the region
    starts inside it. The handle must name the allocation's base (what the driver maps), once per allocation."""
    driver = FakeDriver()
    driver.alloc(0x1000, bytes(range(256)) * 4)
    driver.alloc(0x50000, bytes(300))
    inside = [Region(0x1000 + 64, 512, 0, "cuda"), Region(0x1000 + 640, 128, 0, "cuda")]
    exported: list[int] = []
    real_export = driver.export
    driver.export = lambda addr: exported.append(addr) or real_export(addr)  # type: ignore[method-assign]
    allocations, why = cuda_ipc.export_regions(inside, driver)
    assert exported == [0x1000]  # one handle for the allocation, whichever regions lie in it
    assert why == "" and [(a["addr"], a["bytes"]) for a in allocations] == [(0x1000, 1024)]
    assert driver.handles == {base64.b64decode(allocations[0]["handle"]): 0x1000}
    cuda_ipc.pull(allocations, [Pair("w", 0x50000, 0x1000 + 640, 100, 0, 0, "cuda", "cuda")], stream=0, driver=driver)
    assert driver.allocs[0x50000][:100] == driver.allocs[0x1000][640:740]


def test_nothing_is_exported_for_a_region_past_its_allocation_or_without_a_driver() -> None:
    driver = FakeDriver()
    driver.alloc(0x1000, bytes(1024))
    across = [Region(0x1000 + 64, 1024, 0, "cuda")]  # runs into whatever follows: not one allocation
    allocations, why = cuda_ipc.export_regions(across, driver)
    assert allocations is None and "past its allocation" in why
    allocations, why = cuda_ipc.export_regions([Region(0x7777_0000, 64, 0, "cuda")], driver)
    assert allocations is None and "exports no IPC handle" in why
    assert cuda_ipc.export_regions([Region(0x1000, 64, 0, "cpu")], driver)[0] is None


def test_a_refused_open_lands_nothing_and_a_failed_copy_counts_as_landed() -> None:
    driver = FakeDriver()
    regions, pairs = two_allocations(driver)
    allocations, _ = cuda_ipc.export_regions(regions, driver)
    before = bytes(driver.allocs[0x50000])
    driver.fail_open = True
    with pytest.raises(cuda_ipc.CudaIpcError) as refused:
        cuda_ipc.pull(allocations, pairs, stream=0, driver=driver)
    assert refused.value.landed is False and bytes(driver.allocs[0x50000]) == before
    driver.fail_open, driver.fail_copy = False, True
    with pytest.raises(cuda_ipc.CudaIpcError) as failed:
        cuda_ipc.pull(allocations, pairs, stream=0, driver=driver)
    assert failed.value.landed is True and not driver.mapped  # the mappings are closed even then
    outside = [Pair("x", 0x50000, 0x4000, 16, 0, 0, "cuda", "cuda")]
    driver.fail_copy = False
    with pytest.raises(cuda_ipc.CudaIpcError, match="outside every allocation") as stray:
        cuda_ipc.pull(allocations, outside, stream=0, driver=driver)
    assert stray.value.landed is False


_servers: list[ipc_handoff.HandoffServer] = []


@pytest.fixture(autouse=True)
def _close_handoff_servers():
    yield
    while _servers:
        _servers.pop().close()


def record(boot: str, allocations: list[dict] | None) -> types.SimpleNamespace:
    """A source record of this process; its allocations (with their handles) are handed out by a real handoff
    socket, as a source does (transfer/ipc_handoff.py): the record names only the socket."""
    extra: dict = {}
    if allocations:
        _servers.append(ipc_handoff.HandoffServer({"worker": "src-1", "allocations": allocations}).start())
        extra[p2p_source.HANDOFF] = {"socket": _servers[-1].address, "allocations": len(allocations)}
    return types.SimpleNamespace(extra=extra, boot_id=boot, worker="src-1", host="node-a", pid=os.getpid())


@pytest.mark.parametrize("case", ["other boot", "no handles", "turned off", "host memory"])
def test_the_ipc_pull_is_chosen_only_for_gpu_memory_of_a_source_on_this_boot(case: str, monkeypatch) -> None:
    here = p2p.boot_id()
    allocations = [{"addr": 0x1000, "bytes": 64, "handle": base64.b64encode(b"h" * 64).decode()}]
    pairs = [Pair("a", 0x50000, 0x1000, 64, 0, 0, "cpu" if case == "host memory" else "cuda", "cuda")]
    rec = record("another-boot" if case == "other boot" else here, None if case == "no handles" else allocations)
    if case == "turned off":
        monkeypatch.setenv("MXLAUNCH_CUDA_IPC", "0")
    called, skipped = [], []
    monkeypatch.setattr(cuda_ipc, "pull", lambda *a, **k: called.append(a))
    assert p2p._ipc_pull(rec, pairs, skipped) is None and not called
    # only a same-host GPU source that exported nothing is worth a word (its reason, from its record)
    assert bool(skipped) == (case == "no handles") and all("exported no CUDA IPC handles" in s for s in skipped)


def test_a_source_that_exports_no_handles_says_why_in_its_record(monkeypatch) -> None:
    rec = record(p2p.boot_id(), None)
    rec.extra["cuda_ipc_why"] = "region at 0x1000 runs 64 bytes past its allocation"
    skipped: list[str] = []
    pair = Pair("a", 0x50000, 0x1000, 64, 0, 0, "cuda", "cuda")
    assert p2p._ipc_pull(rec, [pair], skipped) is None
    assert skipped == ["src-1: exported no CUDA IPC handles: region at 0x1000 runs 64 bytes past its allocation "
                       "(pulled over NIXL instead)"]


def test_a_same_host_source_whose_memory_cannot_be_opened_is_pulled_over_nixl_and_says_why(monkeypatch) -> None:
    def refused(*_a, **_k):
        raise cuda_ipc.CudaIpcError("cannot open the source's memory: cuIpcOpenMemHandle returned CUresult 201",
                                    landed=False)

    def broke(*_a, **_k):
        raise cuda_ipc.CudaIpcError("a copy out of the source's memory failed", landed=True)

    import torch  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    rec = record(p2p.boot_id(), [{"addr": 0x1000, "bytes": 64, "handle": base64.b64encode(b"h" * 64).decode()}])
    pairs = [Pair("a", 0x50000, 0x1000, 64, 0, 0, "cuda", "cuda")]
    skipped: list[str] = []
    monkeypatch.setattr(cuda_ipc, "pull", refused)
    assert p2p._ipc_pull(rec, pairs, skipped) is None
    assert skipped == ["src-1: CUDA IPC: cannot open the source's memory: cuIpcOpenMemHandle returned CUresult 201 "
                       "(pulled over NIXL instead)"]
    monkeypatch.setattr(cuda_ipc, "pull", broke)
    with pytest.raises(p2p.RestoreError) as landed:
        p2p._ipc_pull(rec, pairs, [])
    assert landed.value.landed is True


def test_host_memory_regions_are_left_to_nixl_and_the_gpu_ones_still_exported() -> None:
    """vLLM 0.26 serves a few tensors from host memory (seen on the H200: 'not every region is GPU memory')."""
    driver = FakeDriver()
    regions, pairs = two_allocations(driver)
    allocations, why = cuda_ipc.export_regions([*regions, Region(0x7000_0000, 64, 0, "cpu")], driver)
    assert why == "" and [a["addr"] for a in allocations] == [0x1000, 0x8000]
    host = Pair("rope", 0x6000_0000, 0x7000_0000, 64, 0, 0, "cpu", "cpu")
    gpu, rest = cuda_ipc.split([*pairs, host])
    assert gpu == pairs and rest == [host]
    assert cuda_ipc.export_regions([Region(0x7000_0000, 64, 0, "cpu")], driver) == (None, "no served region is GPU memory")


def test_a_handle_with_nul_bytes_travels_whole_from_export_to_open() -> None:
    """CUDA IPC handles hold NUL bytes: the H200's first same-GPU pulls sent handles cut at the first one and
    every open failed (CUDA_ERROR_INVALID_VALUE). Real ctypes calls into stand-in driver functions."""
    handle = bytes([7, 0, 0, 3] + [0] * 20 + [9] * 40)
    opened: list[bytes] = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(cuda_ipc._Handle), ctypes.c_uint64)
    def get(out, addr):
        ctypes.memmove(out, handle, cuda_ipc.HANDLE_BYTES)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), cuda_ipc._Handle, ctypes.c_uint)
    def open_(ptr, h, flags):
        opened.append(bytes(h.reserved))
        ptr[0] = 0x7000
        return 0

    noop = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)
    lib = types.SimpleNamespace(cuIpcOpenMemHandle_v2=open_, cuMemcpyDtoDAsync_v2=noop, cuMemGetAddressRange_v2=noop,
                                cuIpcGetMemHandle=get, cuIpcCloseMemHandle=noop, cuStreamSynchronize=noop,
                                cuCtxSetCurrent=noop)
    driver = cuda_ipc.Driver(lib)
    exported = driver.export(0x1000)
    assert exported == handle
    assert driver.open(exported) == 0x7000 and opened == [handle]


def test_a_same_host_pull_copies_the_gpu_pairs_through_the_driver_and_leaves_the_host_ones_to_nixl(monkeypatch) -> None:
    """The success path of the target's choice (p2p._ipc_pull, as p2p.pull calls it): the handles come over the
    source's socket, the GPU pairs alone go to the driver (the fake one: bytes land at their offsets), the host
    pairs come back for NIXL, every mapping is closed and nothing is said."""
    import torch  # noqa: PLC0415

    driver = FakeDriver()
    regions, pairs = two_allocations(driver)
    allocations, why = cuda_ipc.export_regions(regions, driver)
    assert why == ""
    monkeypatch.setattr(cuda_ipc, "Driver", lambda: driver)
    streams: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: streams.append(7) or types.SimpleNamespace(cuda_stream=7))
    copies: list[tuple[int, int, int, int]] = []
    real_copy = driver.copy
    monkeypatch.setattr(driver, "copy", lambda dst, src, n, stream: copies.append((dst, src, n, stream))
                        or real_copy(dst, src, n, stream))
    host = Pair("rope", 0x6000_0000, 0x7000_0000, 64, 0, 0, "cpu", "cpu")
    skipped: list[str] = []
    got = p2p._ipc_pull(record(p2p.boot_id(), allocations), [pairs[0], host, *pairs[1:]], skipped)
    assert got is not None, skipped
    stats, rest = got
    assert rest == [host] and skipped == [] and streams == [7]
    assert [(dst, n, stream) for dst, _, n, stream in copies] == [(p.local_addr, p.bytes, 7) for p in pairs]
    target, first, second = driver.allocs[0x50000], driver.allocs[0x1000], driver.allocs[0x8000]
    assert target[:300] == first[100:400] and target[300:500] == first[700:900] and target[600:1100] == second[12:512]
    assert stats.bytes == sum(p.bytes for p in pairs) and stats.allocations == 2 and not driver.mapped
