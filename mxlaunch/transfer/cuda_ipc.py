"""GPU memory shared between processes of one host through CUDA IPC: a same-host P2P pull's first choice.

Why not NIXL there: between two processes on the *same* GPU, UCX (NIXL's backend) found no CUDA transport and
fell back to "software emulation" over tcp/lo (the H200, vLLM 0.26: 7.94 GiB in 17.6 s, 0.45 GiB/s), while a
device-to-device copy out of an IPC-mapped allocation ran at the GPU's own copy speed (1317 GiB/s,
scripts/probes/probe_same_gpu_ipc.py, retired). Peers on other hosts, or where the driver refuses, keep NIXL.

Source: one handle per allocation holding a region (a region is the part of one caching-allocator segment,
i.e. one cudaMalloc, that the served tensors use: transfer/regions.py), exported with `cuIpcGetMemHandle` on
the allocation's base, which is what the driver names (a region usually starts inside its segment: a segment's
first block is often a buffer that is not served); a segment the driver will not export (cuMemCreate memory:
PyTorch's expandable segments) means no handles at all, and NIXL alone serves. Host-memory regions get no handle:
vLLM 0.26 on the H200 served a few tensors from host memory beside its GPU weights, and those alone go over NIXL.
Target (same boot id, so the same kernel and driver): open each handle (`cuIpcOpenMemHandle`, peer access
enabled lazily when the source sits on another GPU), queue one `cuMemcpyDtoDAsync` per tensor on the caller's
stream, wait, close the mappings. Bytes are then checked against the source's checksums like any pull.

An opened handle grants READ and WRITE to the source's whole segment, to any process that has its 64 bytes,
whatever its uid (shown on the H200), and `cuIpcOpenMemHandle` has no read-only flag. So the handles are never
written into a record (records travel to group registries and Redis): the source hands them over a Unix socket
to peers of its own uid alone, checked by the kernel (transfer/ipc_handoff.py; docs/security.md). The driver
is reached through ctypes (`Driver`), so the logic runs under test with a fake one.
"""

from __future__ import annotations

import base64
import ctypes
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mxlaunch.transfer.tensor_set import Pair

HANDLE_BYTES = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    """A CUDA IPC step failed; `landed` says whether any byte may have been written into the target."""

    def __init__(self, message: str, *, landed: bool) -> None:
        super().__init__(message)
        self.landed = landed


class _Handle(ctypes.Structure):
    # bytes, not chars: a c_char array field reads back cut at its first NUL (the first H200 runs exported
    # handles cut short that way, and every open failed with CUDA_ERROR_INVALID_VALUE)
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class Driver:
    """The few CUDA driver calls this needs, on the context the caller (torch) made current."""

    def __init__(self, lib: Any = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self._open = getattr(self.lib, "cuIpcOpenMemHandle_v2", None) or self.lib.cuIpcOpenMemHandle
        self._copy = getattr(self.lib, "cuMemcpyDtoDAsync_v2", None) or self.lib.cuMemcpyDtoDAsync
        self._range = getattr(self.lib, "cuMemGetAddressRange_v2", None) or self.lib.cuMemGetAddressRange
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        self.lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

    def on_device(self, ordinal: int) -> None:
        """Make the device's primary context (torch's) current in this thread: a thread that has not touched
        CUDA yet (a source publishing from a background thread) has none, and every call would fail."""
        current = ctypes.c_void_p(0)
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        device, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise OSError(f"{what} returned CUresult {rc}")

    def allocation(self, addr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        self._check(self._range(ctypes.byref(base), ctypes.byref(size), addr), "cuMemGetAddressRange")
        return base.value, size.value

    def export(self, addr: int) -> bytes:
        handle = _Handle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), addr), "cuIpcGetMemHandle")
        return bytes(handle.reserved)

    def open(self, handle: bytes) -> int:
        ptr = ctypes.c_uint64(0)
        if len(handle) != HANDLE_BYTES:
            raise OSError(f"a CUDA IPC handle is {HANDLE_BYTES} bytes, not {len(handle)}")
        self._check(self._open(ctypes.byref(ptr), _Handle((ctypes.c_ubyte * HANDLE_BYTES).from_buffer_copy(handle)),
                               CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return ptr.value

    def close(self, ptr: int) -> None:
        self.lib.cuIpcCloseMemHandle(ptr)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._copy(dst, src, nbytes, stream or None), "cuMemcpyDtoDAsync")

    def wait(self, stream: int) -> None:
        self._check(self.lib.cuStreamSynchronize(stream or None), "cuStreamSynchronize")


def export_regions(regions: Sequence[Any], driver: Optional[Driver] = None) -> tuple[Optional[list[dict]], str]:
    """One handle per allocation holding a GPU region, as the record's `cuda_ipc` list: (allocations, "") or
    (None, why not). Host-memory regions are left out (a served set may hold a few: vLLM 0.26 keeps some
    buffers in host memory); a target copies those over NIXL and the rest through the handles."""
    cuda = [r for r in regions if r.kind == "cuda"]
    if not cuda:
        return None, "no served region is GPU memory"
    try:
        driver = driver or Driver()
        driver.on_device(cuda[0].dev)
        out: dict[int, dict] = {}
        for r in cuda:
            base, size = driver.allocation(r.addr)
            if r.addr + r.bytes > base + size:
                return None, f"region at {r.addr:#x} runs {r.addr + r.bytes - base - size} bytes past its allocation"
            if base not in out:  # the handle names the whole allocation: a region may start inside it
                out[base] = {"addr": base, "bytes": size, "handle": base64.b64encode(driver.export(base)).decode()}
        return sorted(out.values(), key=lambda a: a["addr"]), ""
    except (OSError, AttributeError) as exc:
        return None, f"the driver exports no IPC handle here ({exc})"


def split(pairs: Sequence[Pair]) -> tuple[list[Pair], list[Pair]]:
    """(GPU-to-GPU pairs, the rest): the first go through the handles, the rest over NIXL."""
    gpu: list[Pair] = []
    rest: list[Pair] = []
    for p in pairs:
        (gpu if p.local_kind == "cuda" and p.remote_kind == "cuda" else rest).append(p)
    return gpu, rest


@dataclass
class IpcStats:
    bytes: int
    open_seconds: float
    transfer_seconds: float
    allocations: int


def pull(allocations: Sequence[dict], pairs: Sequence[Pair], stream: int, driver: Optional[Driver] = None) -> IpcStats:
    """Copy every pair out of the source's allocations. CudaIpcError(landed=False) when nothing was queued."""
    if any(p.local_kind != "cuda" or p.remote_kind != "cuda" for p in pairs):
        raise CudaIpcError("CUDA IPC moves GPU memory only", landed=False)
    spans = sorted((int(a["addr"]), int(a["bytes"]), a["handle"]) for a in allocations)
    started = time.perf_counter()
    try:
        driver = driver or Driver()
        driver.on_device(pairs[0].local_dev if pairs else 0)
    except (OSError, AttributeError) as exc:
        raise CudaIpcError(f"no CUDA driver to open IPC handles ({exc})", landed=False) from exc
    mapped: dict[int, int] = {}  # source allocation address → its mapping here
    try:
        plan = []
        for p in pairs:
            span = next((s for s in spans if s[0] <= p.remote_addr and p.remote_addr + p.bytes <= s[0] + s[1]), None)
            if span is None:
                raise CudaIpcError(f"{p.name} lies outside every allocation the source exported", landed=False)
            if span[0] not in mapped:
                try:
                    mapped[span[0]] = driver.open(base64.b64decode(span[2]))
                except OSError as exc:
                    raise CudaIpcError(f"cannot open the source's memory: {exc}", landed=False) from exc
            plan.append((p.local_addr, mapped[span[0]] + p.remote_addr - span[0], p.bytes))
        opened = time.perf_counter()
        try:
            for dst, src, nbytes in plan:
                driver.copy(dst, src, nbytes, stream)
            driver.wait(stream)
        except OSError as exc:
            raise CudaIpcError(f"a copy out of the source's memory failed: {exc}", landed=True) from exc
        return IpcStats(sum(n for _, _, n in plan), opened - started, time.perf_counter() - opened, len(mapped))
    finally:
        for ptr in mapped.values():
            driver.close(ptr)
