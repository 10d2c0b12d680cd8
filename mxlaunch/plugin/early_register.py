"""Register staged files with the GPU driver as they land, while the engine still builds the model.

Copying from a registered (page-locked) staged file runs at the pinned ceiling with no CPU copy; the
registration itself runs at ~20–30 GiB/s for 2 MiB tmpfs pages and does not go faster with more
threads (docs/benchmarks.md). Done inside the weight phase it halves the copy's speed; done while the
engine builds its model — which takes seconds, and staging has usually finished by then — the weight
phase is the copy alone. One background thread walks the rank's files in order, waits for each to
appear (the stager renames complete files into place), maps it read-only and registers it in
`SPAN`-byte pieces (short driver calls, so the engine's own CUDA calls are not held up long).

`take(path)` hands a finished registration to the restore (waiting if that file is being registered
right now); a file the thread has not reached yet is claimed for the ring instead, so the restore never
waits on the registrar. `release()` unregisters and unmaps; `stop()` ends the thread early.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from mxlaunch.plugin import pinned
from mxlaunch.memory.hugepages import FileMapping

SPAN = 256 << 20


@dataclass
class Registered:
    """One staged file, mapped read-only and page-locked."""

    path: str
    size: int
    fd: int
    mapping: FileMapping
    addrs: list[int] = field(default_factory=list)
    seconds: float = 0.0
    span: int = SPAN  # registered in pieces of this size from offset 0: a DMA must not cross one's end

    def release(self) -> None:
        for addr in self.addrs:
            pinned.unregister(addr)
        self.addrs.clear()
        self.mapping.close()
        os.close(self.fd)


def register_file(path: str, device: Any = None, span: int = SPAN) -> Registered | None:
    """Map `path` read-only and register it in `span` pieces; None when it is not on tmpfs."""
    from mxlaunch.plugin.cuda_copier import is_tmpfs

    if not is_tmpfs(Path(path)):
        return None  # page-cache pages of a disk file: registering would read it single-threaded
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mapping = FileMapping(fd, size, writable=False)
    except BaseException:
        os.close(fd)
        raise
    reg = Registered(path, size, fd, mapping, span=span)
    try:
        pinned.register_spans(mapping.addr, size, span, into=reg.addrs, read_only=True)
    except BaseException:
        reg.release()
        raise
    reg.seconds = time.perf_counter() - started
    return reg


class EarlyRegistrar:
    """The background thread that registers a rank's staged files in order, as they appear."""

    def __init__(self, device: Any, files: Sequence[str], *, timeout_s: float = 600.0,
                 cancelled: Callable[[], bool] | None = None) -> None:
        self.device = device
        self.files = [str(Path(f)) for f in files]
        self.timeout_s = timeout_s
        self.cancelled = cancelled
        self.started = time.perf_counter()
        self.finished_at: float | None = None
        self.error: str | None = None
        self._cv = threading.Condition()
        self._done: dict[str, Registered] = {}
        self._claimed: set[str] = set()
        self._current: str | None = None
        self._stop = False
        self.registered_bytes = 0
        self._thread = threading.Thread(target=self._run, name="mxlaunch-early-register", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import torch

            torch.cuda.set_device(self.device)
            deadline = time.perf_counter() + self.timeout_s
            for path in self.files:
                while not os.path.exists(path):
                    if self._stop or time.perf_counter() > deadline or (self.cancelled and self.cancelled()):
                        return
                    time.sleep(0.005)
                with self._cv:
                    if self._stop:
                        return
                    if path in self._claimed:
                        continue
                    self._current = path
                try:
                    reg = register_file(path, self.device, span=SPAN)
                finally:
                    with self._cv:
                        self._current = None
                        self._cv.notify_all()
                if reg is None:
                    continue
                with self._cv:
                    self._done[path] = reg
                    self.registered_bytes += reg.size
                    self._cv.notify_all()
        except Exception as exc:  # noqa: BLE001 - the ring reads whatever is not registered
            self.error = str(exc)
        finally:
            self.finished_at = time.perf_counter()
            with self._cv:
                self._cv.notify_all()

    def take(self, path: str | os.PathLike[str]) -> Registered | None:
        """The file's registration (waiting while it is under way), or None: then it is the ring's."""
        key = str(Path(path))
        with self._cv:
            while self._current == key:
                self._cv.wait()
            reg = self._done.pop(key, None)
            if reg is None:
                self._claimed.add(key)
            return reg

    def wait(self) -> float:
        """Join the thread (benchmarks); seconds from start to the last registration."""
        self._thread.join()
        return (self.finished_at or time.perf_counter()) - self.started

    def stop(self) -> None:
        """End the thread and release what nobody took."""
        with self._cv:
            self._stop = True
        self._thread.join()
        with self._cv:
            left, self._done = list(self._done.values()), {}
        for reg in left:
            reg.release()
