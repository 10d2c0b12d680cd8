"""Staged snapshot files → CUDA tensors at the host link's speed.

The engines' default (and mxlaunch's first restore) copies each tensor from a pageable mmap: the
driver bounces it through its own small pinned buffer, one tensor at a time, 4–5 GiB/s on an H200.
Here every file is cut into fixed windows (`CHUNK`, 2 MiB-aligned) and two kinds of workers take
windows from the two ends of one queue:

- the **registrar** (one thread) page-locks a window of the file's own tmpfs mapping with
  `cudaHostRegister` and copies straight from it — no CPU copy at all; on 2 MiB pages (what
  `mxlaunch stage` lays out) it registers at 25–30 GiB/s, on 4 KiB pages at ~6;
- **ring readers** (N threads) `preadv` a window into a slot of one pre-pinned host buffer
  (`pinned.HostBuffer`, 2 slots per reader) and copy from there; each slot is reused once the copy
  that read it has finished (a CUDA event). Files that are not on tmpfs are read with O_DIRECT.

Measured on the 1×H200 machine (docs/benchmarks.md): the ring alone moves 12 GiB at ~31 GiB/s once
its buffer is pinned; registration stays near 20 GiB/s whatever the thread count (the driver
serialises it) and slows the ring when both run, so `gpu_restore` uses the ring by default and keeps
registration as a mode to measure on other hosts. Copies are issued on one CUDA stream
per worker, so reads, registrations and DMA of different windows overlap, across files too: the
caller submits each file as it appears and calls `finish()` once. A window's bytes go to every
destination tensor that overlaps it (big tensors span windows, small ones share one).

Only contiguous CUDA destinations come here; `loader.py` keeps the rest. Errors raise from
`finish()` (or `submit()`); the caller turns them into RestoreError(landed=True).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxlaunch import settings
from mxlaunch.fileutil import is_tmpfs  # torch-free, shared with the launcher; plugin modules import it from here
from mxlaunch.plugin import pinned
from mxlaunch.memory.hugepages import FileMapping, _libc
from mxlaunch.plugin.tensors import tensor_bytes

CHUNK = 16 << 20          # one window: a ring slot, and the registrar's unit
REGISTER_SPAN = 8         # the registrar takes up to this many consecutive windows per registration
MADV_POPULATE_READ = 22


@dataclass
class Piece:
    """Bytes [begin, end) of the file land in `dest` (a flat uint8 CUDA view of exactly that length)."""

    begin: int
    end: int
    dest: torch.Tensor


@dataclass
class Window:
    file: "_OpenFile"
    begin: int  # 2 MiB-aligned
    end: int    # page-rounded, within the mapped file
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class _OpenFile:
    path: Path
    size: int
    fd: int                         # for preadv (O_DIRECT when not tmpfs)
    direct: bool
    mapping: FileMapping | None     # read-write shared mapping, for registration (tmpfs only)
    registered: list[int] = field(default_factory=list)  # addresses to unregister


@dataclass
class CopyStats:
    registered_bytes: int = 0
    ring_bytes: int = 0
    pinned_bytes: int = 0
    register_seconds: float = 0.0
    unregister_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def cuda_contiguous(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and t.is_contiguous() and t.numel() > 0


def windows_for(file: _OpenFile, items: list[tuple[int, int, torch.Tensor]], chunk: int = CHUNK) -> list[Window]:
    """Cut the file's tensor ranges [(begin, end, dest_tensor)] into aligned windows with their pieces."""
    by_index: dict[int, Window] = {}
    limit = pinned.page_up(file.size)
    for begin, end, dest in items:
        flat = tensor_bytes(dest)
        for k in range(begin // chunk, (end - 1) // chunk + 1):
            lo, hi = max(begin, k * chunk), min(end, (k + 1) * chunk)
            win = by_index.get(k)
            if win is None:
                win = by_index[k] = Window(file, k * chunk, min((k + 1) * chunk, limit))
            win.pieces.append(Piece(lo, hi, flat[lo - begin:hi - begin]))
    return [by_index[k] for k in sorted(by_index)]


class CudaCopier:
    """Copies submitted files into CUDA tensors with one registrar and `readers` ring readers."""

    def __init__(self, device: torch.device, *, ring: pinned.HostBuffer | None, readers: int,
                 register: bool = True, chunk: int = CHUNK, registrars: int = 1,
                 register_span: int = REGISTER_SPAN, early: bool = False) -> None:
        self.device = device
        self.register_span = register_span
        self.populate = settings.gpu_populate()
        self.chunk = chunk
        self.ring = ring
        self.stats = CopyStats(pinned_bytes=ring.nbytes if ring is not None else 0)
        slots = (ring.nbytes // chunk) if ring is not None else 0
        self.readers = min(readers, slots // 2)
        self.register = register
        self._queue: collections.deque[Window] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._files: list[_OpenFile] = []
        self._threads: list[threading.Thread] = []
        self._streams: list[torch.cuda.Stream] = []
        self._registrar_on = register
        self._early_stream: torch.cuda.Stream | None = None
        self.early_files: list[Any] = []  # early_register.Registered, released by the caller
        if not register and self.readers == 0 and not early:
            raise pinned.PinError("neither registration nor a pinned ring is available")
        if register:
            for i in range(max(1, registrars)):
                self._start(self._registrar, f"mxlaunch-register-{i}")
        self._readers_started = False
        if not early:  # with files registered early, readers start only when a file needs the ring
            self._start_readers()

    def _start_readers(self) -> None:
        """The ring's reader threads (each with its CUDA stream): started once, when first needed."""
        if self._readers_started:
            return
        self._readers_started = True
        ring, chunk = self.ring, self.chunk
        for i in range(self.readers):
            assert ring is not None
            slot_pair = (ring.tensor[2 * i * chunk:(2 * i + 1) * chunk], ring.tensor[(2 * i + 1) * chunk:(2 * i + 2) * chunk])
            self._start(lambda pair=slot_pair: self._reader(pair), f"mxlaunch-ring-{i}")

    # ---- the caller's side ------------------------------------------------------------------------

    def submit(self, path: Path, size: int, items: list[tuple[int, int, torch.Tensor]]) -> None:
        """Queue one file's tensor ranges [(file begin, file end, contiguous CUDA tensor)]."""
        self._raise_if_failed()
        tmpfs = is_tmpfs(path)
        direct = False
        fd = -1
        if not tmpfs and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                direct = True
            except OSError:
                fd = -1
        if fd < 0:
            fd = os.open(path, os.O_RDONLY)
        mapping = None
        if tmpfs and self._registrar_on:
            try:
                mapping = FileMapping(fd, size, writable=False)
            except OSError as exc:  # the ring reads it
                self.stats.notes.append(f"{path.name}: not mapped ({exc.strerror or exc})")
        file = _OpenFile(path, size, fd, direct, mapping)
        self._start_readers()
        self._files.append(file)
        windows = windows_for(file, items, self.chunk)
        with self._cv:
            if mapping is None and self.readers == 0:
                raise pinned.PinError(f"{path} was not registered in time and there is no pinned ring")
            self._queue.extend(windows)
            self._cv.notify_all()

    def submit_registered(self, reg: Any, items: list[tuple[int, int, torch.Tensor]]) -> None:
        """A file the early registrar already page-locked: its copies are issued now, from this thread."""
        self._raise_if_failed()
        if self._early_stream is None:
            self._early_stream = torch.cuda.Stream(device=self.device)
            with self._cv:
                self._streams.append(self._early_stream)
        view = reg.mapping.view
        moved = 0
        with torch.cuda.stream(self._early_stream):
            for begin, end, dest in items:
                flat = tensor_bytes(dest)
                # one copy per registered piece: a copy that spans two registrations is refused (EINVAL)
                lo = begin
                while lo < end:
                    hi = min(end, (lo // reg.span + 1) * reg.span)
                    flat[lo - begin:hi - begin].copy_(torch.frombuffer(view[lo:hi], dtype=torch.uint8),
                                                      non_blocking=True)
                    lo = hi
                moved += end - begin
        self.early_files.append(reg)
        with self._cv:
            self.stats.registered_bytes += moved

    def finish(self) -> CopyStats:
        """Wait for every copy, unregister, close the files; raises the first worker error."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        try:
            for s in self._streams:
                s.synchronize()
        finally:
            self._release()
        self._raise_if_failed()
        return self.stats

    def abort(self) -> None:
        """Stop the workers after their current window and release everything (error paths)."""
        with self._cv:
            self._closed = True
            self._error = self._error or RuntimeError("aborted")
            self._queue.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for s in self._streams:
            try:
                s.synchronize()
            except RuntimeError:
                pass
        self._release()
        for reg in self.early_files:
            reg.release()
        self.early_files.clear()

    # ---- workers ------------------------------------------------------------------------------------

    def _start(self, target: Any, name: str) -> None:
        t = threading.Thread(target=self._guard, args=(target,), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, target: Any) -> None:
        try:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(device=self.device)
            with self._cv:
                self._streams.append(stream)
            with torch.cuda.stream(stream):
                target()
        except BaseException as exc:  # noqa: BLE001 - handed to finish()
            with self._cv:
                self._error = self._error or exc
                self._queue.clear()
                self._cv.notify_all()

    def _take(self, left: bool, want: int = 1) -> list[Window] | None:
        """Next windows from one end of the queue; None when closed and drained (or failed).

        The registrar (left) takes the first windows of a file it can map, up to `want` consecutive
        ones; ring readers (right) take the last window, whatever its file.
        """
        with self._cv:
            while True:
                if self._error is not None or (left and not self._registrar_on):
                    return None
                if left:
                    index = next((i for i, w in enumerate(self._queue) if w.file.mapping is not None), None)
                    if index is not None:
                        out = [self._queue[index]]
                        del self._queue[index]
                        while (len(out) < want and len(self._queue) > index and self._queue[index].file is out[-1].file
                               and self._queue[index].begin == out[-1].end):
                            out.append(self._queue[index])
                            del self._queue[index]
                        return out
                elif self._queue:
                    return [self._queue.pop()]
                if self._closed and (not left or not self._queue or self.readers):
                    return None
                self._cv.wait(0.05)

    def _registrar(self) -> None:
        while True:
            windows = self._take(left=True, want=self.register_span)
            if windows is None:
                return
            file = windows[0].file
            assert file.mapping is not None
            begin, end = windows[0].begin, windows[-1].end
            started = time.perf_counter()
            try:
                if self.populate:  # page tables filled here, in parallel registrars, not inside the driver's lock
                    _libc.madvise(file.mapping.addr + begin, end - begin, MADV_POPULATE_READ)
                pinned.register(file.mapping.addr + begin, end - begin, read_only=True)
            except pinned.PinError as exc:
                # Registration refused (locked-memory limit, driver): the ring takes the rest.
                with self._cv:
                    self.stats.notes.append(f"registration stopped: {exc}")
                    self._registrar_on = False  # every registrar stops; the ring reads what is left
                    self._queue.extendleft(reversed(windows))
                    self._cv.notify_all()
                if self.readers == 0:
                    raise
                return
            file.registered.append(file.mapping.addr + begin)
            view = file.mapping.view
            moved = 0
            for w in windows:
                for p in w.pieces:
                    p.dest.copy_(torch.frombuffer(view[p.begin:p.end], dtype=torch.uint8), non_blocking=True)
                    moved += p.end - p.begin
            with self._cv:
                self.stats.register_seconds += time.perf_counter() - started
                self.stats.registered_bytes += moved

    def _reader(self, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
        events: list[torch.cuda.Event | None] = [None, None]
        views = [memoryview(s.numpy()) for s in slots]
        turn = 0
        while True:
            windows = self._take(left=False)
            if windows is None:
                return
            w = windows[0]
            if events[turn] is not None:
                events[turn].synchronize()  # the copy that last read this slot is done
            n = w.end - w.begin
            _read_exact(w.file, views[turn][:n], w.begin)
            slot = slots[turn]
            moved = 0
            for p in w.pieces:
                p.dest.copy_(slot[p.begin - w.begin:p.end - w.begin], non_blocking=True)
                moved += p.end - p.begin
            with self._cv:
                self.stats.ring_bytes += moved
            ev = torch.cuda.Event()
            ev.record()
            events[turn] = ev
            turn ^= 1

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _release(self) -> None:
        started = time.perf_counter()
        for f in self._files:
            pinned.release_mapped(f)
        self.stats.unregister_seconds += time.perf_counter() - started
        self._files.clear()


def _read_exact(file: _OpenFile, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset`; the file may end inside the last (page-rounded) window."""
    need = min(len(view), file.size - offset)
    done = 0
    while done < need:  # O_DIRECT asks for the whole (aligned) window; the read stops short at EOF
        got = os.preadv(file.fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{file.path} ended early at byte {offset + done}")
        done += got
