"""Page-locked host memory for the GPU weight paths: registering staged files, and a reusable ring.

Why not `torch.empty(pin_memory=True)`: on the 1×H200 machine it allocates at 1.3–2.5 GiB/s (every
4 KiB page faulted, zeroed and pinned), and torch's caching host allocator keeps the pages after the
tensor is freed — the engine wants that memory back once weights are in place. Here a buffer is an
anonymous mapping advised into 2 MiB pages and registered with `cudaHostRegister`, and `close()`
unregisters and unmaps it: nothing pinned outlives the load.

A staged file (2 MiB tmpfs pages, laid out by `mxlaunch stage`) registers at 25–30 GiB/s and then
copies to the GPU at the pinned ceiling, with no bounce buffer (docs/benchmarks.md). Registration runs
in the driver under one lock — more threads do not make it faster — so it is done by one thread,
chunk after chunk, while the copies of earlier chunks run.

CUDA calls go through `torch.cuda.cudart()`; torch is imported by the caller (plugin side only).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from mxlaunch.memory.hugepages import HUGE, _libc

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the GPU only reads; unregistering is ~2× faster
_MADV_HUGEPAGE = 14
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANON = 0x02 | 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value


class PinError(RuntimeError):
    """Host memory could not be page-locked (out of locked memory, a driver refusal, no CUDA)."""


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def register(addr: int, nbytes: int, *, read_only: bool = False) -> None:
    """Page-lock [addr, addr + nbytes) for DMA; PinError with CUDA's error name on failure."""
    rt = _cudart()
    err = rt.cudaHostRegister(addr, nbytes, REGISTER_READ_ONLY if read_only else 0)
    if int(err) != 0:
        if read_only:  # drivers without read-only registration: the plain kind works as well
            return register(addr, nbytes, read_only=False)
        _clear_cuda_error()
        raise PinError(f"cudaHostRegister of {nbytes} bytes failed: {_error_name(err)}")


def unregister(addr: int) -> None:
    rt = _cudart()
    err = rt.cudaHostUnregister(addr)
    if int(err) != 0:
        _clear_cuda_error()


def register_spans(addr: int, nbytes: int, span: int, *, into: list[int], read_only: bool = False,
                   stop: Any = None) -> None:
    """Page-lock [addr, addr + nbytes) in `span`-byte registrations (short driver calls), appending each
    registered address to `into` as it goes (the caller unregisters them, also after an error); `stop()`
    true ends early. A DMA must then not cross a span's end (`cudaErrorInvalidValue`)."""
    end = page_up(nbytes)
    for begin in range(0, end, span):
        if stop is not None and stop():
            return
        register(addr + begin, min(span, end - begin), read_only=read_only)
        into.append(addr + begin)


def release_mapped(item: Any) -> None:
    """Unregister, unmap and close a mapped file: any object with `registered` (addresses), `mapping`
    (memory.hugepages.FileMapping or None) and `fd` (-1 when closed); safe to call twice."""
    for addr in item.registered:
        unregister(addr)
    item.registered.clear()
    if item.mapping is not None:
        item.mapping.close()
        item.mapping = None
    if item.fd >= 0:
        os.close(item.fd)
        item.fd = -1


def _error_name(err: Any) -> str:
    name = getattr(err, "name", None)
    return str(name or err)


def _clear_cuda_error() -> None:
    """cudaHostRegister failures are sticky in cudaGetLastError; clear it so torch does not trip on it."""
    try:
        import torch

        torch.cuda.cudart().cudaGetLastError()
    except Exception:  # noqa: BLE001
        pass


class HostBuffer:
    """`nbytes` of page-locked host memory, 2 MiB-aligned, with a uint8 torch view; close() frees it."""

    def __init__(self, nbytes: int) -> None:
        import torch

        if nbytes <= 0:
            raise ValueError("a host buffer needs a positive size")
        self.nbytes = -(-nbytes // HUGE) * HUGE
        span = self.nbytes + HUGE
        base = _libc.mmap(None, span, _PROT_READ_WRITE, _MAP_PRIVATE_ANON, -1, 0)
        if base in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise PinError(f"cannot map {self.nbytes} bytes of host memory: {os.strerror(err)}")
        self._base, self._span = base, span
        self.addr = (base + HUGE - 1) // HUGE * HUGE
        _libc.madvise(self.addr, self.nbytes, _MADV_HUGEPAGE)  # best effort: 4 KiB pages still work
        try:
            register(self.addr, self.nbytes)
        except PinError:
            _libc.munmap(self._base, self._span)
            self._base = None
            raise
        self._view = memoryview((ctypes.c_char * self.nbytes).from_address(self.addr)).cast("B")
        self.tensor = torch.frombuffer(self._view, dtype=torch.uint8)

    def close(self) -> None:
        if self._base is None:
            return
        del self.tensor
        unregister(self.addr)
        try:
            self._view.release()
        except BufferError:  # a tensor view of it is still alive somewhere: leave it mapped (not pinned)
            self._base = None
            return
        _libc.munmap(self._base, self._span)
        self._base = None

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EarlyBuffer:
    """A HostBuffer allocated in a background thread, so its cost overlaps the engine building the model.

    `start(nbytes)` returns at once; `take()` waits for it and hands it over (or None when pinning
    failed: the caller then copies without a ring and says why in `error`).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._buffer: HostBuffer | None = None
        self.error: str | None = None
        self.seconds = 0.0

    def start(self, nbytes: int, device: int | None = None) -> "EarlyBuffer":
        import time

        def allocate() -> None:
            started = time.perf_counter()
            try:
                if device is not None:
                    import torch

                    torch.cuda.set_device(device)
                self._buffer = HostBuffer(nbytes)
            except (PinError, RuntimeError, OSError, ValueError) as exc:
                self.error = str(exc)
            self.seconds = time.perf_counter() - started

        self._thread = threading.Thread(target=allocate, name="mxlaunch-pin", daemon=True)
        self._thread.start()
        return self

    def take(self) -> HostBuffer | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        buffer, self._buffer = self._buffer, None
        return buffer
