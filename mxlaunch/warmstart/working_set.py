"""The file pages a snapshotted process tree had touched, recorded at the dump and read ahead at a restore.

Why: a restored engine maps its interpreter, torch's and CUDA's libraries and the engine's code from the same files
as before, and CRIU restores those mappings without reading them. On a node whose page cache holds none of them (a
new node, or one that evicted them) every first touch after the restore is a page fault served from the disk, one
at a time, while the engine answers its first requests: on an H100 the wiped node's restore reached /health ~4 s
later than the same node's with the software cached (docs/benchmarks.md, session 26). The pages the tree had
present are known at the dump (/proc/PID/pagemap's present bit, readable by the process's own user); asking the
kernel to read exactly those ranges ahead (posix_fadvise WILLNEED, from a few threads) while the image and the
weights stage turns the faults into a few large reads that overlap the rest of the restore.

Nothing here changes what is restored: a file whose size or modification time differs from the dump's is skipped
(CRIU refuses such a restore anyway), and a missing file is skipped. The read-ahead only fills the page cache.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from mxlaunch import settings

PAGE = os.sysconf("SC_PAGE_SIZE")
GAP = 1 << 20  # ranges closer than this are read as one: fewer, larger reads
MAX_BYTES = 16 << 30  # never read more than this ahead (a guard: a record of code is a few GB at most)
SKIP_PREFIXES = ("/dev/", "/proc/", "/sys/", "/memfd:", "/anon_hugepage", "/SYSV")
_PRESENT = bytes.maketrans(bytes(range(256)), bytes(49 if b & 0x80 else 48 for b in range(256)))  # bit 63 → "1"


def is_code(path: str, perms: str) -> bool:
    """A mapping of code: executable, or any segment of a shared object (its read-only data and relocations). Data
    files a process maps (a checkpoint's safetensors, a locale archive) are left out: a restore that refills the
    weights from the stage must not read the checkpoint ahead."""
    return "x" in perms or ".so" in path.rsplit("/", 1)[-1]


def _file_mappings(pid: int) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of each mapping of a shared object or executable file by `pid`."""
    out = []
    try:
        lines = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith("(deleted)"):
            continue
        if parts[5].startswith(SKIP_PREFIXES) or parts[3] == "00:00" or not is_code(parts[5], parts[1]):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end, int(parts[2], 16), parts[5]))
    return out


def _present_runs(pagemap: Any, start: int, end: int) -> list[tuple[int, int]]:
    """Runs (first page, pages) of pages present in [start, end), from the open /proc/PID/pagemap; the whole
    range when it cannot be read (another user's process, an old kernel)."""
    first, count = start // PAGE, (end - start) // PAGE
    try:
        pagemap.seek(first * 8)
        data = pagemap.read(count * 8)
    except OSError:
        return [(0, count)]
    if len(data) != count * 8:
        return [(0, count)]
    flags = data[7::8].translate(_PRESENT)  # the top byte of each 64-bit entry
    return [(m.start(), m.end() - m.start()) for m in re.finditer(b"1+", flags)]


def record(pids: Sequence[int], skip: Iterable[str] = ()) -> list[dict]:
    """The file ranges the processes `pids` have present, per file: [{path, size, mtime_ns, ranges: [[offset,
    length], ...]}], sorted by path. `skip`: path prefixes left out (the run folder, the staged weights)."""
    skipped = tuple(skip)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for pid in pids:
        try:
            pagemap = open(f"/proc/{pid}/pagemap", "rb", buffering=0)
        except OSError:
            pagemap = None
        try:
            for start, end, offset, path in _file_mappings(pid):
                if skipped and path.startswith(skipped):
                    continue
                runs = _present_runs(pagemap, start, end) if pagemap is not None else [(0, (end - start) // PAGE)]
                ranges.setdefault(path, []).extend((offset + p * PAGE, n * PAGE) for p, n in runs)
        finally:
            if pagemap is not None:
                pagemap.close()
    out = []
    for path, spans in sorted(ranges.items()):
        try:
            st = os.stat(path)
        except OSError:
            continue
        merged = coalesce(spans, st.st_size)
        if merged:
            out.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ranges": merged})
    return out


def coalesce(spans: Iterable[tuple[int, int]], size: int, gap: int = GAP) -> list[list[int]]:
    """Sorted, merged [offset, length] ranges within a file of `size` bytes; ranges less than `gap` apart join."""
    out: list[list[int]] = []
    for offset, length in sorted(spans):
        end = min(offset + length, size)
        if end <= offset:
            continue
        if out and offset <= out[-1][0] + out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], end - out[-1][0])
        else:
            out.append([offset, end - offset])
    return out


def _read_ahead(entry: Mapping[str, Any], budget: list[int], lock: threading.Lock) -> tuple[int, Optional[str]]:
    """Ask the kernel to read one file's ranges into the page cache: (bytes asked, why skipped or None)."""
    try:
        fd = os.open(entry["path"], os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return 0, exc.strerror or str(exc)
    try:
        st = os.fstat(fd)
        if st.st_size != entry.get("size") or st.st_mtime_ns != entry.get("mtime_ns"):
            return 0, "changed since the dump"
        asked = 0
        for offset, length in entry.get("ranges", []):
            with lock:
                length = min(int(length), budget[0])
                budget[0] -= length
            if length <= 0:
                break
            os.posix_fadvise(fd, int(offset), length, os.POSIX_FADV_WILLNEED)
            asked += length
        return asked, None
    except (OSError, TypeError, ValueError) as exc:
        return 0, str(exc)
    finally:
        os.close(fd)


def read_ahead(entries: Sequence[Mapping[str, Any]], threads: int = 4, max_bytes: int = MAX_BYTES) -> dict:
    """Read every recorded range ahead, largest files first, from `threads` threads; what it did (files, bytes
    asked, files skipped, seconds). A file that cannot be opened or advised is skipped, not raised: the page faults
    then do its work."""
    t0 = time.monotonic()
    budget, lock = [max_bytes], threading.Lock()
    order = sorted(entries, key=lambda e: -sum(int(r[1]) for r in e.get("ranges", []) if len(r) == 2))
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="mx-readahead") as pool:
        done = list(pool.map(lambda e: _read_ahead(e, budget, lock), order))
    return {"files": sum(1 for asked, why in done if why is None), "bytes": sum(asked for asked, _ in done),
            "skipped": sum(1 for _, why in done if why is not None), "seconds": round(time.monotonic() - t0, 3)}


class ReadAhead:
    """read_ahead in a daemon thread, started as soon as a restore is decided; `result()` waits for it."""

    def __init__(self, entries: Sequence[Mapping[str, Any]], threads: int = 4) -> None:
        self._result: dict = {}
        self._thread = threading.Thread(target=self._run, args=(entries, threads), name="mx-readahead", daemon=True)
        self._thread.start()

    def _run(self, entries: Sequence[Mapping[str, Any]], threads: int) -> None:
        self._result = read_ahead(entries, threads)

    def result(self, timeout: Optional[float] = None) -> dict:
        self._thread.join(timeout)
        return dict(self._result) if not self._thread.is_alive() else {"running": True}


def start(meta: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Optional[ReadAhead]:
    """The read-ahead of a snapshot's recorded pages (its meta.json's `working_set`), started now; None when it
    recorded none or $MXLAUNCH_SNAPSHOT_READ_AHEAD turns it off. Both restores call this: engine snapshots and
    zygote images."""
    entries = meta.get("working_set")
    return ReadAhead(entries) if entries and settings.snapshot_read_ahead(environ) else None
