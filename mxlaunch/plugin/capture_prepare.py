"""Capture with no write: the part files laid out in tmpfs, and page-locked, while the engine loads.

The writers' path (plugin/cuda_capture.py) moves a 12 GiB rank from an H200 into /dev/shm at
13–18 GiB/s, 0.36× of the device→host link: tmpfs allocating and zeroing pages under the writers is
the limit (docs/benchmarks.md). Yet everything that costs is known before a weight is loaded — names,
dtypes and shapes, hence every part's header, size and offsets — and the engine's own loader then
spends seconds to minutes reading the checkpoint. So when a capture goes to tmpfs, `start()` (called
at the top of the load step) creates each part under its temp name, sizes it, lays it out in 2 MiB
pages, writes its header and page-locks it for the GPU, on one background thread. The capture is then
one device→host copy per tensor straight into the file's pages (a DMA, no CPU copy, no write call) and
a rename per part. CPU tensors take the same path with a memcpy.

`take(groups)` hands the prepared parts to the capture when the tensors are still those it prepared
for (names, dtypes, shapes, in order); otherwise — a loader that replaced a parameter, a preparation
that failed — it removes the temp files, says why, and the writers' path runs. A part appears under its
final name only when every byte is in; any error removes all temp files. Page-locked memory is released
on a background thread after the copy (`release_pending()` joins it); nothing pinned outlives loading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from mxlaunch import settings
from mxlaunch.fileutil import is_tmpfs, nearest_existing
from mxlaunch.plugin.tensors import CaptureError, Group, group_tensors, tensor_bytes

log = logging.getLogger("mxlaunch.plugin")

SPAN = 256 << 20          # one registration: short driver calls beside the engine's own loading
PAGER_SLICE = 64 << 20    # 2 MiB-aligned
MADV_POPULATE_WRITE = 23  # Linux ≥ 5.14: allocate (and zero) every page of the range now
_releases: list[threading.Thread] = []


def signature(groups: Iterable[Group]) -> list[tuple]:
    """What fixes the files' bytes layout: each group's names, dtype and shape, in order."""
    return [(tuple(g.names), g.tensor.dtype, tuple(g.tensor.shape)) for g in groups]


def eligible(groups: list[Group], out_dir: Path) -> str | None:
    """None when the capture can be prepared; else why not (for the log)."""
    if not settings.capture_prepare():
        return "MXLAUNCH_CAPTURE_PREPARE=0"
    if not groups:
        return "no tensors"
    devices = {g.tensor.device for g in groups}
    if len(devices) != 1:
        return "the tensors live on several devices"
    if not is_tmpfs(nearest_existing(out_dir)):
        return f"{out_dir} is not on tmpfs"
    return None


@dataclass
class _Part:
    final: Path
    tmp: Path
    groups: list[Group]
    header: bytes
    size: int
    fd: int = -1
    mapping: Any = None                       # memory.hugepages.FileMapping
    registered: list[int] = field(default_factory=list)

    def close(self) -> None:
        from mxlaunch.plugin import pinned

        pinned.release_mapped(self)


class PreparedCapture:
    """The parts of one rank's capture, prepared in the background: see the module docstring."""

    def __init__(self, groups: list[Group], out_dir: str | os.PathLike[str], *,
                 metadata: dict[str, str] | None = None, part_bytes: int | None = None) -> None:
        from mxlaunch.plugin.capture import capture_meta, part_jobs, temp_path
        from mxlaunch.plugin.snapshot_files import PART_BYTES, _header

        self.out = Path(out_dir)
        self.signature = signature(groups)
        self.device = groups[0].tensor.device if groups else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        meta, aliases = capture_meta(groups, metadata)
        self.parts = []
        for final, part, part_meta in part_jobs(groups, self.out, meta, aliases, part_bytes or PART_BYTES):
            header = _header(part, part_meta)
            size = len(header) + sum(g.tensor.numel() * g.tensor.element_size() for g in part)
            self.parts.append(_Part(final, temp_path(final), part, header, size))
        self.error: str | None = None
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.huge_bytes = 0
        self._stop = False
        self._written = False
        self._thread = threading.Thread(target=self._run, name="mxlaunch-capture-prepare", daemon=True)

    @classmethod
    def start(cls, named: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike[str], *,
              metadata: dict[str, str] | None = None, part_bytes: int | None = None) -> "PreparedCapture | None":
        """Begin preparing when the capture can use it; None (and one debug line) otherwise."""
        groups = group_tensors(named)
        why = eligible(groups, Path(out_dir))
        if why:
            log.debug("mxlaunch: the capture is not prepared during loading: %s", why)
            return None
        prep = cls(groups, out_dir, metadata=metadata, part_bytes=part_bytes)
        prep._thread.start()
        return prep

    # ---- the background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            self.out.mkdir(parents=True, exist_ok=True)
            pager = _pager()
            with ThreadPoolExecutor(prepare_threads(len(self.parts)), thread_name_prefix="mxlaunch-prepare",
                                    initializer=self._on_device) as pool:
                for done in [pool.submit(self._lay_out, part, pager) for part in self.parts]:
                    done.result()
            self.huge_bytes = pager.collapsed
        except Exception as exc:  # noqa: BLE001 - the writers' path runs instead; take() says why
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.seconds = time.perf_counter() - started

    def _on_device(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)

    def _lay_out(self, part: _Part, pager: Any) -> None:
        from mxlaunch.plugin import pinned
        from mxlaunch.memory.hugepages import FileMapping, _libc

        if self._stop:
            return
        part.fd = os.open(part.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(part.fd, part.size)
        part.mapping = FileMapping(part.fd, part.size)
        for begin in range(0, part.size, PAGER_SLICE):  # slices: a thread meets another's probe for one slice only
            if pager.enabled:
                pager.prepare(part.mapping, part.fd, begin, min(part.size, begin + PAGER_SLICE))
        # every other page now, off the capture's clock (tmpfs allocation was the writers' limit)
        _libc.madvise(part.mapping.addr, part.size, MADV_POPULATE_WRITE)
        part.mapping.view[:len(part.header)] = part.header
        if self.cuda:
            pinned.register_spans(part.mapping.addr, part.size, SPAN, into=part.registered, stop=lambda: self._stop)

    # ---- the capture's side -------------------------------------------------------------------------

    def take(self, groups: list[Group]) -> "PreparedCapture | None":
        """Wait for the preparation; self when it fits `groups`, else None (temp files removed, reason logged)."""
        waited = time.perf_counter()
        self._thread.join()
        self.wait_seconds = time.perf_counter() - waited
        why = self.error
        if why is None and signature(groups) != self.signature:
            why = "the model's tensors changed during loading"
        if why is None and self._stop:
            why = "cancelled"
        if why is not None:
            log.warning("mxlaunch: the prepared capture files are not used (%s); writing the parts instead", why)
            self.discard()
            return None
        return self

    def write(self, groups: list[Group], fsync: bool = True) -> tuple[list[Path], int]:
        """Copy every group into its prepared part, then rename the parts into place: (files, bytes)."""
        done: list[Path] = []
        total = 0
        try:
            stream = torch.cuda.Stream(device=self.device) if self.cuda else None
            if stream is not None:
                torch.cuda.synchronize(self.device)  # the engine's own streams have finished with the weights
            index = 0
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for part in self.parts:
                    offset = len(part.header)
                    for g in part.groups:
                        live = groups[index].tensor
                        index += 1
                        offset += self._copy(part, offset, live)
                        total += live.numel() * live.element_size()
            if stream is not None:
                stream.synchronize()
            for part in self.parts:
                if fsync:
                    os.fsync(part.fd)
                os.replace(part.tmp, part.final)
                done.append(part.final)
        except BaseException as exc:
            for path in done:
                path.unlink(missing_ok=True)
            self.discard()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CaptureError(f"cannot write the snapshot into {self.out}: {exc}") from exc
        self._written = True
        self._release_later()
        return done, total

    def _copy(self, part: _Part, offset: int, tensor: torch.Tensor) -> int:
        """tensor's bytes → the part's pages at `offset`; copies never span two registrations."""
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            return 0
        flat = tensor_bytes(tensor)
        view = part.mapping.view
        lo = offset
        while lo < offset + n:
            hi = min(offset + n, (lo // SPAN + 1) * SPAN) if self.cuda else offset + n
            dest = torch.frombuffer(view[lo:hi], dtype=torch.uint8)
            dest.copy_(flat[lo - offset:hi - offset], non_blocking=self.cuda)
            lo = hi
        return n

    def discard(self) -> None:
        """Stop the preparation (if running), release what it holds and remove the temp files.

        A no-op once `write()` has put the parts in place (their release then runs on its own thread)."""
        if self._written:
            return
        self._stop = True
        if self._thread.is_alive():
            self._thread.join()
        for part in self.parts:
            part.close()
            part.tmp.unlink(missing_ok=True)

    def _release_later(self) -> None:
        """Unregister and unmap on a thread (~0.1 s per 10 GiB), joined by release_pending()."""
        parts = list(self.parts)
        t = threading.Thread(target=lambda: [p.close() for p in parts], name="mxlaunch-capture-release",
                             daemon=True)
        t.start()
        _releases.append(t)


def release_pending() -> float:
    """Join the background release of prepared parts; seconds waited."""
    started = time.perf_counter()
    while _releases:
        _releases.pop().join()
    return time.perf_counter() - started


def prepare_threads(parts: int) -> int:
    """Parts laid out at once: a collapse zeroes 2 MiB pages at ~6 GiB/s on one core (1×H200 machine), and
    the engine is loading meanwhile — a quarter of the cores, at most 4."""
    return max(1, min(4, parts, (os.cpu_count() or 1) // 4))


def _pager() -> Any:
    """2 MiB pages while they are cheap (registration of 2 MiB pages is ~5× faster than of 4 KiB ones);
    off the capture's clock, so the limit is generous."""
    from mxlaunch.memory.hugepages import HugePager

    return HugePager(max_cpu_s_per_gib=2.0)
