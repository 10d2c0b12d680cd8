"""The staging engine's records and small helpers: modes, results, per-file state, rate limit, buffers."""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mxlaunch.errors import MxlaunchError
from mxlaunch.memory.hugepages import FileMapping
from mxlaunch.staging.sources import CopyItem

ALIGN = 4096
DEFAULT_CHUNK = 16 << 20
# How bytes reach the destination file:
#   mmap   — O_DIRECT read straight into a shared mapping of the destination: no memcpy and no
#            bounce buffer. Default: with the destination collapsed into 2 MiB pages (hugepages.py)
#            it took 0.23–0.26× dd's CPU per GiB on the 2×H200 host at 1.05–1.08× dd's speed; where
#            2 MiB pages are dear and it falls back to 4 KiB pages, every page is faulted in through
#            get_user_pages (more CPU than pwrite, but still the fastest mode on the 2-core VM).
#   pwrite — O_DIRECT read into a reused, pre-faulted per-thread buffer, then pwrite() (one memcpy in
#            the kernel). Cheapest in CPU when the destination stays in 4 KiB pages.
#   procs  — pwrite's reads and writes done by reader *processes* (staging/worker.py), one per reader
#            thread: separate address spaces do not contend on one process's memory locks.
WRITE_MODES = ("pwrite", "mmap", "procs")
WORKER = Path(__file__).with_name("worker.py")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class StageCancelled(MxlaunchError):
    """The stage was interrupted (SIGINT/SIGTERM or cancel()); everything it wrote is gone."""

    exit_code = 130


@dataclass(frozen=True)
class StagedFile:
    """A file that is complete under its final name."""

    src: Path
    dest: Path
    rel: str
    bytes: int
    seconds: float  # since the job started
    o_direct: bool
    xxh3_128: str | None = None


@dataclass
class StageResult:
    files: list[StagedFile]
    bytes: int
    seconds: float
    readers: int
    chunk_size: int
    o_direct: bool
    huge_bytes: int = 0  # bytes that landed in 2 MiB pages (hugepages.py)
    huge_note: str | None = None  # why 2 MiB pages were not (or no longer) used

    @property
    def gib_per_s(self) -> float:
        return self.bytes / (1 << 30) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _FileState:
    item: CopyItem
    dest: Path
    partial: Path
    remaining: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    src_fd: int | None = None
    dest_fd: int | None = None
    mapping: FileMapping | None = None  # aligned map of the destination (mmap mode, 2 MiB pages)
    o_direct: bool = True
    done: bool = False


class _RateLimiter:
    """Total bytes/s ceiling shared by all readers (be a good neighbour on a shared filesystem)."""

    def __init__(self, bytes_per_s: float, cancelled: threading.Event) -> None:
        self.rate = bytes_per_s
        self.next_free = time.monotonic()
        self.lock = threading.Lock()
        self.cancelled = cancelled

    def acquire(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + nbytes / self.rate
        delay = start - time.monotonic()
        if delay > 0:
            self.cancelled.wait(delay)


def _prefault(buf: mmap.mmap) -> None:
    """Fault a reused buffer in once, up front (MADV_POPULATE_WRITE, Linux ≥ 5.14: no Python copy)."""
    try:
        buf.madvise(23)  # MADV_POPULATE_WRITE
    except (OSError, ValueError):
        buf.write(b"\0" * len(buf))
