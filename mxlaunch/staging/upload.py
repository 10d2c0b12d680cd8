"""Uploading a capture from node-local /dev/shm to the store: big sequential copies in background threads.

The plugin writes a rank's parts into the run folder in /dev/shm (RAM speed); the launcher then copies
them into the store's temp folder for that rank (launch/capture_upload.py). Each file is read once from RAM in
large chunks, hashed (xxh3-128, the manifest's checksum) from the very bytes written, written under a
temp name, fsynced and renamed: a file appears in the store's temp folder only complete, and nothing
reads the store back to checksum it. A few files go at once (parallel streams suit Lustre and NFS);
`cancel` stops every copy within one chunk, and a failed or cancelled copy leaves no temp file.

    job = UploadJob([UploadItem(rank, rel, src, dst, size), ...]); job.start()
    ... job.running / job.done_bytes / job.error ... job.results  # (rank, rel) → Uploaded
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import xxhash

CHUNK = 16 << 20  # bytes per read/write: big sequential I/O, and the step at which a cancel is seen
WRITERS = 4  # files copied at once

Progress = Callable[[int], None]
Cancelled = Callable[[], bool]


class UploadCancelled(Exception):
    """The job was cancelled (the launcher is stopping, or another file failed)."""


@dataclass(frozen=True)
class UploadItem:
    rank: int
    rel: str  # path inside the rank's folder (the manifest's relative path)
    src: Path
    dst: Path
    size: int


@dataclass(frozen=True)
class Uploaded:
    rank: int
    rel: str
    bytes: int
    xxh3_128: str


def copy_file(src: Path, dst: Path, *, chunk: int = CHUNK, progress: Progress = lambda n: None,
              cancelled: Cancelled = lambda: False) -> tuple[int, str]:
    """Copy `src` to `dst` (temp name, fsync, rename) and return (bytes, xxh3-128 of the bytes written).

    Raises OSError on an I/O problem, UploadCancelled when `cancelled()` turns true; the temp file is
    removed either way and `dst` never appears half-written."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}-{threading.get_ident()}.upload.tmp")
    digest = xxhash.xxh3_128()
    buf = memoryview(bytearray(chunk))
    total = 0
    try:
        with open(src, "rb", buffering=0) as fin:
            expected = os.fstat(fin.fileno()).st_size
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with open(fd, "wb", buffering=0) as fout:
                while True:
                    if cancelled():
                        raise UploadCancelled(f"{src.name}: cancelled")
                    n = fin.readinto(buf)
                    if not n:
                        break
                    view = buf[:n]
                    digest.update(view)
                    while view:  # a raw write may take part of the chunk
                        view = view[fout.write(view):]
                    total += n
                    progress(n)
                os.fsync(fout.fileno())
        if total != expected:
            raise OSError(f"{src} changed while it was uploaded ({expected} bytes at the start, {total} read)")
        os.replace(tmp, dst)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return total, digest.hexdigest()


class UploadJob:
    """Copy `items` with `writers` threads (largest first); the first failure cancels the rest."""

    def __init__(self, items: list[UploadItem], *, writers: int = WRITERS, chunk: int = CHUNK,
                 copy: Callable[..., tuple[int, str]] = copy_file) -> None:
        self.items = sorted(items, key=lambda i: -i.size)
        self.writers = max(1, min(writers, len(items))) if items else 0
        self.chunk = chunk
        self.copy = copy
        self.total_bytes = sum(i.size for i in items)
        self.results: dict[tuple[int, str], Uploaded] = {}
        self.error: Optional[str] = None
        self.started_at: Optional[float] = None
        self.ended_at: Optional[float] = None
        self._done = 0
        self._next = 0
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._threads: list[threading.Thread] = []
        self._active = 0

    # ---- state ----

    @property
    def done_bytes(self) -> int:
        return self._done

    @property
    def running(self) -> bool:
        """True until every copy thread has finished its last file (or stopped)."""
        return self.started_at is not None and self.ended_at is None

    @property
    def ok(self) -> bool:
        return not self.running and self.error is None and len(self.results) == len(self.items)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def seconds(self) -> float:
        if self.started_at is None:
            return 0.0
        return (self.ended_at or time.monotonic()) - self.started_at

    # ---- control ----

    def start(self) -> "UploadJob":
        self.started_at = time.monotonic()
        self._active = self.writers if self.items else 0
        self._threads = [threading.Thread(target=self._work, name=f"mx-upload-{i}", daemon=True)
                         for i in range(self.writers)]
        for t in self._threads:
            t.start()
        if not self.items:
            self.ended_at = self.started_at
        return self

    def cancel(self) -> None:
        self._cancel.set()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the copy threads; True once none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # ---- the threads ----

    def _take(self) -> Optional[UploadItem]:
        with self._lock:
            if self._next >= len(self.items) or self._cancel.is_set():
                return None
            self._next += 1
            return self.items[self._next - 1]

    def _progress(self, n: int) -> None:
        with self._lock:
            self._done += n

    def _work(self) -> None:
        item: Optional[UploadItem] = None
        try:
            while (item := self._take()) is not None:
                size, digest = self.copy(item.src, item.dst, chunk=self.chunk, progress=self._progress,
                                         cancelled=self._cancel.is_set)
                with self._lock:
                    self.results[(item.rank, item.rel)] = Uploaded(item.rank, item.rel, size, digest)
        except UploadCancelled:
            pass
        except Exception as exc:  # noqa: BLE001 — reported through `error`; the launcher gives the capture up
            with self._lock:
                if self.error is None:
                    what = f"{item.src.name} of rank {item.rank}: " if item is not None else ""
                    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
                    self.error = f"{what}{getattr(exc, 'strerror', None) or exc}{where}"
            self._cancel.set()
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.ended_at = time.monotonic()
