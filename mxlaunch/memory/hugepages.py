"""2 MiB pages for tmpfs destinations, without remounting /dev/shm.

Filling a tmpfs file 4 KiB page at a time is the CPU floor of staging: every page is allocated,
charged to the memory cgroup and inserted into the file's page cache under a lock — about
0.3–0.6 CPU s per GiB, whoever writes (docs/benchmarks.md). `/dev/shm` is normally mounted
`huge=never`, so tmpfs never picks 2 MiB pages by itself, but `madvise(MADV_COLLAPSE)` (Linux ≥ 6.1)
builds them on request regardless of the mount option: give each 2 MiB block of the destination one
present page, collapse the block into a 2 MiB folio (one allocation, one zeroing, one page-cache
entry), then write or read into it with no per-4-KiB work at all.

A fresh 2 MiB page is not always cheap: memory that a hypervisor reclaimed (free page reporting) is
faulted back 4 KiB at a time on first touch, and a fragmented host may compact. `HugePager` therefore
measures what each collapse costs and stops collapsing for the rest of a job once it costs more than
the 4 KiB pages it replaces — the copy is then exactly what it was without it.

Only the standard library (ctypes): Python's `mmap` cannot place a mapping at a 2 MiB-aligned address,
which a collapse needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time

HUGE = 2 << 20
MADV_COLLAPSE = 25
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class FileMapping:
    """A shared read-write mapping of a whole file at a 2 MiB-aligned address.

    Aligned so that file offset X sits at an address ≡ X (mod 2 MiB): only then can a 2 MiB block of
    the file be mapped (and collapsed) as one huge page. `view` is a writable memoryview for preadv
    and hashing. The caller must not touch `view` after close() (there is no export tracking, as
    Python's mmap has): the staging engine closes a file's mapping only when no reader holds it.
    """

    def __init__(self, fd: int, size: int, *, writable: bool = True) -> None:
        if size <= 0:
            raise ValueError("cannot map an empty file")
        self.size = size
        self._span = size + HUGE
        base = _libc.mmap(None, self._span, 0, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap reserve failed: {os.strerror(err)}")
        self._base = base
        addr = (base + HUGE - 1) // HUGE * HUGE
        prot = _PROT_READ_WRITE if writable else 0x1  # read-only: the GPU path only reads staged files
        got = _libc.mmap(addr, size, prot, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != addr:
            err = ctypes.get_errno()
            _libc.munmap(base, self._span)
            raise OSError(err, f"mmap of the destination failed: {os.strerror(err)}")
        self.addr = addr
        self.view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")

    def close(self) -> None:
        if self._base is not None:
            self.view.release()
            _libc.munmap(self._base, self._span)
            self._base = None


class HugePager:
    """Collapse destination ranges into 2 MiB pages while that costs less CPU than 4 KiB pages.

    Shared by all readers of a job. The first collapses are a probe, done by one thread at a time
    while the others wait for its verdict, so an expensive verdict costs one chunk, not one per
    reader. They wait rather than fill 4 KiB pages meanwhile because those fills would be measured
    into the verdict: on the 16-core H200 host, 16 threads filling 4 KiB pages pay 2.4–3.8 CPU s/GiB
    (their page allocations contend), a collapse made among 15 such threads cost 1.05–2.6 s/GiB, over
    the limit, while collapses alone cost 0.4–0.7 with the copy (scripts/probes/probe_tmpfs_landing.py, retired) — and
    the S3 staging lost its 2 MiB pages, and a third of its rate, in two runs of three (docs/benchmarks.md).
    A probe is short (a collapse fills 2 MiB pages at several GiB/s), so the wait is milliseconds.
    After the probe, a running average over the last `window` bytes keeps watching: memory
    can get dearer mid-job (compaction), and then collapsing stops. At most `concurrent` collapses
    run at once: collapses of one file share its page-cache lock, and 32 readers collapsing together
    spun their way past the cost limit on the 2×H200 host (docs/benchmarks.md); one collapse fills
    2 MiB pages at several GiB/s, so a few slots keep ahead of any disk.

    `max_cpu_s_per_gib` is what 4 KiB pages would cost instead, minus a margin: 0.3 when the bytes
    are copied in with pwrite (a 4 KiB tmpfs page costs 0.4–0.6 CPU s/GiB to allocate and fill, a
    collapsed one ~0.1 to fill), 0.9 when O_DIRECT reads land in the mapping (4 KiB pages are then
    faulted in and zeroed one by one: ~1 CPU s/GiB; on the 2-core VM collapses at 0.6–0.7 s/GiB
    still cut the stage's CPU per GiB from 1.25 to 0.8 while they lasted).
    """

    def __init__(self, enabled: bool = True, max_cpu_s_per_gib: float = 0.3, probe_bytes: int = 32 << 20,
                 window: int = 256 << 20, concurrent: int = 4) -> None:
        self.enabled = enabled
        self.max_cost = max_cpu_s_per_gib / (1 << 30)  # CPU s per byte
        self.probe_bytes = probe_bytes
        self.window = window
        self._lock = threading.Lock()
        self._probe_done = threading.Condition(self._lock)  # the probe's waiters, told at each probe's end
        self._slots = threading.BoundedSemaphore(concurrent)
        self._probing = False
        self._bytes = 0  # bytes collapsed so far
        self._avg = 0.0  # running average CPU s per byte
        self.collapsed = 0
        self.reason: str | None = None  # why collapsing stopped, for the record

    def prepare(self, mapping: FileMapping, fd: int, start: int, end: int) -> bool:
        """Collapse the whole 2 MiB blocks inside [start, end) before they are filled; True if done.

        Only blocks wholly inside the range are touched: the range belongs to one reader, so no
        other thread writes there meanwhile. Bytes written to make a page present are zeros that the
        chunk's data overwrites.
        """
        if not self.enabled:
            return False
        lo = -(-start // HUGE) * HUGE
        hi = end // HUGE * HUGE
        if hi <= lo:
            return False
        with self._lock:
            while self._probing:  # another reader is probing: its verdict first (see the class docstring)
                self._probe_done.wait()
            if not self.enabled:
                return False
            in_probe = self._bytes < self.probe_bytes
            if in_probe:
                self._probing = True
        try:
            with self._slots:
                if not self.enabled:
                    return False
                t0 = time.thread_time()
                for off in range(lo, hi, HUGE):
                    os.pwrite(fd, b"\0", off)
                rc = _libc.madvise(mapping.addr + lo, hi - lo, MADV_COLLAPSE)
                err = ctypes.get_errno() if rc else 0
                cost = time.thread_time() - t0
            with self._lock:  # recorded before the probe's waiters wake: they see its verdict
                if rc != 0:
                    # EINVAL: kernel < 6.1 or THP off; EAGAIN/ENOMEM: no 2 MiB page to be had. Either way
                    # the range was left in 4 KiB pages, which is correct, only not faster.
                    self._stop(f"MADV_COLLAPSE failed: {errno.errorcode.get(err, err)}")
                    return False
                self._record(hi - lo, cost)
                self.collapsed += hi - lo
            return True
        finally:
            if in_probe:
                with self._lock:
                    self._probing = False
                    self._probe_done.notify_all()

    def _record(self, nbytes: int, cost: float) -> None:
        per_byte = cost / nbytes
        if self._bytes == 0:
            self._avg = per_byte
        else:
            weight = min(1.0, nbytes / min(self.window, self._bytes + nbytes))
            self._avg += (per_byte - self._avg) * weight
        self._bytes += nbytes
        if self._bytes >= self.probe_bytes and self._avg > self.max_cost:
            self._stop(f"2 MiB pages cost {self._avg * (1 << 30):.2f} CPU s/GiB here (limit {self.max_cost * (1 << 30):.2f})")

    def _stop(self, reason: str) -> None:
        if self.enabled:
            self.enabled = False
            self.reason = reason

