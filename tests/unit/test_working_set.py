"""warmstart/working_set.py: the file pages a process had present are recorded from /proc (exactly the touched
regions, not whole files) and read ahead into the page cache at a restore (checked with mincore(2)), skipping
files that changed or went away."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mxlaunch.warmstart import working_set
from mxlaunch.warmstart.working_set import PAGE, coalesce, read_ahead, record

MIB = 1 << 20


def _file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return path


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: Path) -> list[bool]:
    """mincore(2) over the whole file: which of its pages are in the page cache (mapping it touches none)."""
    size = path.stat().st_size
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        out = [bool(v & 1) for v in vec]
        del vec
    return out


def _covered(entry: dict, offset: int) -> bool:
    return any(start <= offset < start + length for start, length in entry["ranges"])


def test_record_holds_the_pages_a_process_touched_not_the_whole_file(tmp_path: Path) -> None:
    data = _file(tmp_path / "libengine.so.1", 32 * MIB)
    weights = _file(tmp_path / "model.safetensors", MIB)  # a data file it maps: never read ahead
    touch = (0, 12 * MIB, 24 * MIB)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import mmap, sys\n"
         f"f = open({str(data)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
         f"g = open({str(weights)!r}, 'rb'); w = mmap.mmap(g.fileno(), 0, prot=mmap.PROT_READ)\n"
         f"total = sum(m[o] for o in {touch!r}) + w[0]\n"
         "print('ready', total, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("ready")
        entries = {e["path"]: e for e in record([child.pid])}
        skipped = {e["path"] for e in record([child.pid], skip=(str(tmp_path),))}
    finally:
        child.kill()
        child.wait()
    entry = entries[str(data)]
    assert str(weights) not in entries and any(".so" in Path(p).name for p in entries if p != str(data)), sorted(entries)
    assert entry["size"] == 32 * MIB and entry["mtime_ns"] == data.stat().st_mtime_ns
    # every touched page, with what the kernel mapped around it (fault-around, a large folio: up to 2 MiB here) ...
    assert all(_covered(entry, o) for o in touch), entry
    assert not _covered(entry, 6 * MIB) and not _covered(entry, 18 * MIB), entry  # ... and not the rest
    assert sum(length for _, length in entry["ranges"]) <= 12 * MIB, entry
    assert str(data) not in skipped  # a skipped prefix (the run folder, the staged weights) is left out


def test_coalesce_merges_near_ranges_and_clips_to_the_file() -> None:
    assert coalesce([(8192, 4096), (0, 4096), (10 * MIB, 4096)], 10 * MIB + 100, gap=MIB) == \
        [[0, 12288], [10 * MIB, 100]]
    assert coalesce([(0, 4096), (20 * MIB, 4096)], 4096) == [[0, 4096]]  # beyond the end: gone
    assert coalesce([], 4096) == []


def test_read_ahead_brings_the_recorded_ranges_into_the_page_cache(tmp_path: Path) -> None:
    data = _file(tmp_path / "engine.so", 8 * MIB)
    _evict(data)
    before = _resident(data)
    wanted = [(0, MIB), (5 * MIB, MIB)]
    pages = [p for start, length in wanted for p in range(start // PAGE, (start + length) // PAGE)]
    if any(before[p] for p in pages):
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED (tmpfs?)")
    st = data.stat()
    done = read_ahead([{"path": str(data), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                        "ranges": [list(r) for r in wanted]}])
    assert done["files"] == 1 and done["bytes"] == 2 * MIB and done["skipped"] == 0, done
    deadline = time.monotonic() + 30  # WILLNEED starts the reads; they land a moment later
    while not all(_resident(data)[p] for p in pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    now = _resident(data)
    assert all(now[p] for p in pages), sum(now[p] for p in pages)


def test_read_ahead_skips_changed_and_missing_files_and_keeps_to_its_budget(tmp_path: Path) -> None:
    a, b = _file(tmp_path / "a.so", 2 * MIB), _file(tmp_path / "b.so", 2 * MIB)
    sa, sb = a.stat(), b.stat()
    entries = [{"path": str(a), "size": sa.st_size, "mtime_ns": sa.st_mtime_ns, "ranges": [[0, 2 * MIB]]},
               {"path": str(b), "size": sb.st_size, "mtime_ns": sb.st_mtime_ns - 1, "ranges": [[0, MIB]]},
               {"path": str(tmp_path / "gone.so"), "size": 1, "mtime_ns": 1, "ranges": [[0, 1]]}]
    done = read_ahead(entries)
    assert (done["files"], done["bytes"], done["skipped"]) == (1, 2 * MIB, 2), done
    capped = read_ahead(entries[:1], max_bytes=MIB)
    assert capped["bytes"] == MIB, capped


def test_a_restore_reads_ahead_in_the_background(tmp_path: Path) -> None:
    data = _file(tmp_path / "x.so", MIB)
    st = data.stat()
    job = working_set.ReadAhead([{"path": str(data), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                  "ranges": [[0, MIB]]}])
    assert job.result(timeout=60) == {**job.result(), "files": 1, "bytes": MIB, "skipped": 0}
