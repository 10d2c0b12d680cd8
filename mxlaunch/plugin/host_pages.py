"""Host (CPU) destinations made ready before a restore reads into them: page tables filled in one call.

A CPU engine's parameters come from `torch.empty`: memory no page backs yet. A `preadv` into it takes one
page fault per 4 KiB page inside the kernel's copy (524,288 for 2 GiB), each allocating and zeroing its
page. Filling the range's page tables first in one call (`MADV_POPULATE_WRITE`, Linux ≥ 5.14) does the
same work without the fault path: the restore of a 2 GiB Llama-shaped model on the 2-core VM went from
0.66 s to 0.50 s (1.31×, medians of 5 fresh processes, `scripts/bench/bench_cpu_restore.py`).

Asking for 2 MiB pages as well (`MADV_HUGEPAGE` on the tensor's aligned interior; THP is "madvise" on most
distributions) was bimodal there: 0.37–0.42 s when huge pages were free, 1.15–1.59 s when the kernel
compacted memory to make them (`defrag` = madvise stalls the faulting thread). So it is opt-in ("huge").

Neither call changes a byte: populating an already-present page does nothing, and a huge-page hint only
changes how later faults are served. Any error (an old kernel, THP off) leaves the plain path; nothing
here can fail a restore. `MXLAUNCH_RESTORE_HOST_PAGES` = populate (default) | huge | 0.
"""

from __future__ import annotations

import ctypes
import os

from mxlaunch import settings
from mxlaunch.memory.hugepages import HUGE, _libc  # the project's one libc binding (madvise typed there)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_populate_works = True  # cleared by the first EINVAL (a kernel before 5.14): no point asking again


def enabled() -> bool:
    return settings.restore_host_pages() != "0"


def huge_wanted() -> bool:
    return settings.restore_host_pages() == "huge"


def ask_huge(addr: int, nbytes: int) -> bool:
    """Ask for 2 MiB pages on the 2 MiB-aligned part of [addr, addr + nbytes) (only this range's bytes)."""
    lo, hi = (addr + HUGE - 1) & ~(HUGE - 1), (addr + nbytes) & ~(HUGE - 1)
    return hi > lo and _libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def populate(addr: int, nbytes: int) -> bool:
    """Fill the page tables of [addr, addr + nbytes) for writing, now, in one call (contents unchanged)."""
    global _populate_works
    if not _populate_works or nbytes <= 0:
        return False
    lo = addr & ~(PAGE - 1)
    if _libc.madvise(lo, addr + nbytes - lo, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == 22:  # EINVAL: this kernel has no MADV_POPULATE_WRITE
        _populate_works = False
    return False
