"""The pinned GPU path for one restore: which mode, how many ring readers, the ring itself, the report.

`prepare(device, files)` runs while the engine builds the model (the adapters call it first thing in
their load step): it pins the ring in the background, and registers the rank's staged files with the
driver as they land (plugin/early_register.py), so that the weight phase is the DMA from those files
alone. A file not registered in time goes through the ring. `GpuRestore` is what `restore_tensors` uses for contiguous
CUDA destinations; when pinning fails before a byte lands it is simply not used (pageable copies, one
warning line); the ring and the registered files are unpinned on a thread once the copies are done
(`release_pending()` joins it before the `loaded` marker) — nothing pinned outlives the load.

Settings (docs/plugin.md): MXLAUNCH_GPU_COPY = auto (files registered early + ring) | ring |
hybrid (registrar in the weight phase + ring) | register | pageable; MXLAUNCH_GPU_READERS = ring readers (default one per core, at most 16);
MXLAUNCH_GPU_CHUNK_MIB = one slot (default 16; 2 slots per reader: 512 MiB pinned at 16 readers);
MXLAUNCH_GPU_REGISTRARS / MXLAUNCH_GPU_REGISTER_MIB for the registering modes. On the 1×H200 machine
the ring alone was fastest (scripts/bench/bench_gpu_load.py --sweep, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Sequence

import torch

from mxlaunch import settings
from mxlaunch.plugin import pinned
from mxlaunch.plugin.cuda_copier import CHUNK, CudaCopier


MODES = settings.GPU_COPY_MODES
_early: pinned.EarlyBuffer | None = None
_early_bytes = 0
_registrar: Any = None  # early_register.EarlyRegistrar, started by prepare()
_releases: list[threading.Thread] = []


def gpu_copy_mode() -> str:
    """MXLAUNCH_GPU_COPY (mxlaunch/settings.py): auto, ring, hybrid, register, pageable."""
    return settings.gpu_copy()


def ring_readers() -> int:
    """MXLAUNCH_GPU_READERS, else one per core up to 16 (reads from tmpfs cost memory bandwidth, not cores)."""
    readers = settings.gpu_readers()
    return readers if readers is not None else max(1, min(16, os.cpu_count() or 1))


def chunk_bytes() -> int:
    """MXLAUNCH_GPU_CHUNK_MIB: one ring slot / copy window (a multiple of 2 MiB)."""
    return max(2, (settings.gpu_chunk_mib() or (CHUNK >> 20)) // 2 * 2) << 20


def registrars() -> int:
    """MXLAUNCH_GPU_REGISTRARS: threads registering staged files inside the weight phase (hybrid, register)."""
    return max(1, settings.gpu_registrars() or 1)


def register_span(chunk: int) -> int:
    """MXLAUNCH_GPU_REGISTER_MIB: bytes one registration covers, in windows."""
    return max(1, ((settings.gpu_register_mib() or 128) << 20) // chunk)


def ring_bytes(readers: int, chunk: int | None = None) -> int:
    return readers * 2 * (chunk or chunk_bytes())


def prepare(device: Any, files: Sequence[str] = (), *, timeout_s: float = 600.0,
            cancelled: Callable[[], bool] | None = None) -> None:
    """Called while the engine builds the model: pin the ring, and (auto) register `files` as they land."""
    global _early, _early_bytes, _registrar
    mode = gpu_copy_mode()
    if mode == "pageable":
        return
    index = torch.device(device).index if not isinstance(device, int) else device
    if files and mode == "auto" and _registrar is None:
        from mxlaunch.plugin.early_register import EarlyRegistrar

        _registrar = EarlyRegistrar(index, files, timeout_s=timeout_s, cancelled=cancelled)
    readers = ring_readers()
    if _early is not None or mode == "register" or readers <= 0:
        return
    _early_bytes = ring_bytes(readers)
    _early = pinned.EarlyBuffer().start(_early_bytes, index)


def release_pending() -> float:
    """Join the background unregistration of early-registered files (before the loaded marker); seconds."""
    started = time.perf_counter()
    while _releases:
        _releases.pop().join()
    return time.perf_counter() - started


def _take_ring(nbytes: int, device: torch.device) -> tuple[pinned.HostBuffer | None, float, str | None]:
    """The early ring if one was started (waiting for it), else a new one; (buffer, seconds, why not)."""
    global _early
    started = time.perf_counter()
    early, _early = _early, None
    if early is not None:
        buffer = early.take()
        if buffer is not None and buffer.nbytes >= nbytes:
            return buffer, time.perf_counter() - started, None
        if buffer is not None:
            buffer.close()
    try:
        return pinned.HostBuffer(nbytes), time.perf_counter() - started, None
    except (pinned.PinError, RuntimeError, OSError) as exc:
        return None, time.perf_counter() - started, str(exc)


class GpuRestore:
    """The pinned path for one restore: a CudaCopier, its ring, and what it did (for the marker/log)."""

    def __init__(self, device: torch.device, mode: str) -> None:
        self.started = time.perf_counter()
        self.device = device
        # Work the engine queued on the destinations (initialisation kernels) ends before our streams write.
        torch.cuda.current_stream(device).synchronize()
        self.mode = mode
        self.report: dict = {"mode": mode}
        global _registrar
        self.registrar, _registrar = _registrar, None
        readers = ring_readers() if mode in ("auto", "ring", "hybrid") else 0
        self.ring: pinned.HostBuffer | None = None
        if readers:
            self.ring, pin_seconds, why = _take_ring(ring_bytes(readers), device)
            self.report["pin_wait_seconds"] = round(pin_seconds, 4)
            if self.ring is None:
                self.report["ring_unavailable"] = why
                readers = 0
        try:
            chunk = chunk_bytes()
            self.copier = CudaCopier(device, ring=self.ring, readers=readers,
                                     register=mode in ("hybrid", "register"), chunk=chunk,
                                     registrars=registrars(), register_span=register_span(chunk),
                                     early=self.registrar is not None)
        except BaseException:
            self._free_ring()
            if self.registrar is not None:
                self.registrar.stop()
            raise
        self._done = False

    @classmethod
    def for_targets(cls, tensors: list[torch.Tensor]) -> "GpuRestore | None":
        """A pinned path when the targets live on one CUDA device; None keeps the pageable copies."""
        mode = gpu_copy_mode()
        # non-contiguous CUDA targets count too: they land through scratch tensors (plugin/scratch_landing.py)
        devices = {t.device for t in tensors if t.device.type == "cuda" and t.numel() > 0}
        if mode == "pageable" or len(devices) != 1:
            return None
        try:
            return cls(devices.pop(), mode)
        except (pinned.PinError, RuntimeError, OSError) as exc:
            import logging

            logging.getLogger("mxlaunch.plugin").warning(
                "mxlaunch: the pinned GPU copy is unavailable, copying through pageable memory: %s", exc)
            return None

    def submit(self, header: Any, items: list[tuple[Any, Any]]) -> None:
        """`items`: [(FileEntry, Group)] of one file whose destinations are contiguous CUDA tensors."""
        ranges = [(e.begin, e.end, g.tensor) for e, g in items]
        reg = self.registrar.take(header.path) if self.registrar is not None else None
        if reg is not None and reg.size == header.size:
            self.copier.submit_registered(reg, ranges)
            return
        if reg is not None:  # not the file we were promised: never copy from it
            reg.release()
        self.copier.submit(header.path, header.size, ranges)

    def finish(self) -> dict:
        self.report["issued_seconds"] = round(time.perf_counter() - self.started, 4)  # every copy queued by then
        stats = self.copier.finish()  # every copy has completed: nothing reads the ring or the files now
        self._done = True
        ring, self.ring = self.ring, None
        early = self.copier.early_files
        self.copier.early_files = []
        if self.registrar is not None:
            self.registrar.stop()
            self.report.update({"early_registered_bytes": sum(r.size for r in early),
                                "early_register_seconds": round(sum(r.seconds for r in early), 4)})
            if self.registrar.error:
                self.report["early_register_error"] = self.registrar.error
        if early or ring is not None:
            # Unpinning takes ~0.1 s per 10 GiB, the ring's 512 MiB ~10 ms (measured inside the weight phase
            # on 2×H200: the restore 0.25 s against 0.236 s for its bare copies): off the weight phase,
            # on a thread joined before the `loaded` marker (release_pending).
            def release() -> None:
                for r in early:
                    r.release()
                if ring is not None:
                    ring.close()
            t = threading.Thread(target=release, name="mxlaunch-unregister", daemon=True)
            t.start()
            _releases.append(t)
        self.report.update({
            "registered_bytes": stats.registered_bytes, "ring_bytes": stats.ring_bytes,
            "pinned_bytes": stats.pinned_bytes, "readers": self.copier.readers,
            "registrars": registrars() if self.mode in ("hybrid", "register") else 0,
            "register_seconds": round(stats.register_seconds, 4),
            "unregister_seconds": round(stats.unregister_seconds, 4),
            "seconds": round(time.perf_counter() - self.started, 4),
        })
        if stats.notes:
            self.report["notes"] = stats.notes[:5]
        return dict(self.report)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.copier.abort()
        if self.registrar is not None:
            self.registrar.stop()
        self._free_ring()

    def _free_ring(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
