"""Files over HTTP with parallel ranged GETs: every file cut into chunks, one pool of connections for all
of them, each chunk written in place (pwrite) into `<dest>.incomplete`.

A file appears under its final name only once every chunk is in and its hash matches; until then it is
`<dest>.incomplete`, with `<dest>.incomplete.chunks` listing the chunks already written, so that an
interrupted download (a killed launcher, a dropped connection) resumes where it stopped. A chunk that
fails is tried again (`TRIES` times) before the download fails.

Disk space is checked before the first byte (what is still to come against what the filesystem has free, per
filesystem), and a disk that fills up during the download anyway (someone else wrote to it) ends it with one
line; then this download's `.incomplete` files are removed, since keeping them would hold the space it lacks.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx

from mxlaunch.errors import CheckFailed, MxlaunchError
from mxlaunch.remote import direct
from mxlaunch.memory.hugepages import FileMapping, HugePager

CHUNK = 16 << 20
WORKERS = 16
TRIES = 3


class DownloadCancelled(MxlaunchError):
    """The download was stopped (a signal, a lost claim): the .incomplete files stay for the next one."""


@dataclass
class Target:
    """One file to fetch: where from, where to, how big, and how to check it once whole."""

    url: str
    dest: Path
    size: int
    check: Callable[[Path], Optional[str]]  # None when the file is right, else what is wrong
    refused_fix: str = "check the hub id and HF_TOKEN, or try again later"  # what to do when the server refuses
    direct: bool = False  # a presigned URL: read into the file's mapping over http.client (remote/direct.py)
    # a direct target's check on its bytes where they landed (the mapping), instead of reading the file back
    check_view: Optional[Callable[[memoryview], Optional[str]]] = None
    _done: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def partial(self) -> Path:
        return self.dest.with_name(self.dest.name + ".incomplete")

    @property
    def chunks_file(self) -> Path:
        return self.dest.with_name(self.dest.name + ".incomplete.chunks")

    def nchunks(self, chunk: int) -> int:
        return max(1, -(-self.size // chunk))


def _resume(t: Target, chunk: int) -> set[int]:
    """The chunks a previous download already wrote (only if its .incomplete has the full size)."""
    try:
        if t.partial.stat().st_size != t.size:
            return set()
        doc = json.loads(t.chunks_file.read_text())
        if doc.get("chunk") != chunk or doc.get("size") != t.size:
            return set()
        return {int(i) for i in doc.get("done", []) if 0 <= int(i) < t.nchunks(chunk)}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()


def _record(t: Target, chunk: int) -> None:
    tmp = t.chunks_file.with_name(t.chunks_file.name + ".tmp")
    tmp.write_text(json.dumps({"chunk": chunk, "size": t.size, "done": sorted(t._done)}))
    os.replace(tmp, t.chunks_file)


FULL = (errno.ENOSPC, errno.EDQUOT)


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_room(targets: list[Target], chunk: int = CHUNK) -> None:
    """CheckFailed when a filesystem has less free than the bytes still to come into it (resumed chunks are
    there already). Callers run it before they announce a download; `download` runs it again."""
    need: dict[int, list] = {}  # st_dev → [folder, bytes still to come]
    for t in targets:
        t.dest.parent.mkdir(parents=True, exist_ok=True)
        done = _resume(t, chunk)
        todo = t.size - sum(min(chunk, t.size - i * chunk) for i in done)
        need.setdefault(os.stat(t.dest.parent).st_dev, [t.dest.parent, 0])[1] += todo
    for folder, todo in need.values():
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if todo > free:
            raise CheckFailed(f"not enough disk space in {folder}: the download needs {_size(todo)} more, "
                              f"{_size(free)} is free", "free space there, or point HF_HUB_CACHE / --artifact-path "
                              "at a filesystem with room")


def _discard(targets: list[Target]) -> None:
    for t in targets:
        for gone in (t.partial, t.chunks_file, t.chunks_file.with_name(t.chunks_file.name + ".tmp")):
            gone.unlink(missing_ok=True)


def download(client: httpx.Client, targets: list[Target], *, chunk: int = CHUNK, workers: int = WORKERS,
             progress: Callable[[int], None] = lambda n: None, cancelled: Callable[[], bool] = lambda: False,
             on_file: Callable[[Target], None] = lambda t: None, pager: Optional[HugePager] = None) -> int:
    """Fetch every target; returns the bytes fetched now (resumed chunks are not fetched again). Chunks are
    fetched in the targets' order, and each file is checked and renamed in as soon as its last chunk is in
    (`on_file` is told), so a reader can take the first files while the rest arrive. Raises CheckFailed (a
    chunk that kept failing, a file whose hash is wrong: that file is removed) or DownloadCancelled.

    `pager` (destinations on tmpfs): each direct chunk's 2 MiB blocks are collapsed into huge pages before
    its bytes land, as the local staging does (memory/hugepages.py), while that is cheaper than 4 KiB pages."""
    tasks: "queue.Queue[tuple[Target, int]]" = queue.Queue()
    fds: dict[Path, int] = {}
    maps: dict[Path, FileMapping] = {}  # direct targets: the .incomplete file's pages, written in place
    fds_lock = threading.Lock()
    fetched = 0

    def finish(t: Target) -> None:
        """Every chunk of `t` is in: check it, then rename it in."""
        with fds_lock:
            fd, mapped = fds.pop(t.dest, None), maps.pop(t.dest, None)
        on_mapping = mapped is not None and t.check_view is not None  # checked where the bytes landed: no read-back
        try:
            wrong = t.check_view(mapped.view) if on_mapping else None
        finally:
            if mapped is not None:
                mapped.close()
            if fd is not None:
                os.close(fd)
        if not on_mapping:
            wrong = t.check(t.partial)
        if wrong is not None:
            for gone in (t.partial, t.chunks_file):
                gone.unlink(missing_ok=True)
            raise CheckFailed(f"{_shown(t.url)} arrived wrong ({wrong}); it was removed",
                              "run the launch again: it downloads the file anew")
        os.replace(t.partial, t.dest)
        t.chunks_file.unlink(missing_ok=True)
        on_file(t)

    try:
        for t in targets:
            t.dest.parent.mkdir(parents=True, exist_ok=True)
            t._done = _resume(t, chunk)
            if not t._done:
                for stale in (t.partial, t.chunks_file):
                    stale.unlink(missing_ok=True)
        check_room(targets, chunk)
        whole: list[Target] = []  # resumed with every chunk in
        for t in targets:
            if t._done:
                progress(sum(min(chunk, t.size - i * chunk) for i in t._done))
            fd = os.open(t.partial, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, t.size)
            fds[t.dest] = fd
            if t.direct and t.size and direct.usable(t.url):
                maps[t.dest] = FileMapping(fd, t.size)
            todo = [i for i in range(t.nchunks(chunk)) if i not in t._done]
            for i in todo:
                tasks.put((t, i))
            if not todo:
                whole.append(t)
        for t in whole:
            finish(t)
        errors: list[BaseException] = []
        count_lock = threading.Lock()

        def work() -> None:
            conns: direct.Conns = {}  # this thread's connections for direct targets
            try:
                fetch_all(conns)
            finally:
                direct.close_all(conns)

        def fetch_all(conns: direct.Conns) -> None:
            nonlocal fetched
            while not errors:
                try:
                    t, i = tasks.get_nowait()
                except queue.Empty:
                    return
                try:
                    mapped = maps.get(t.dest)
                    if mapped is not None:
                        n = _fetch_direct(conns, t, i, chunk, mapped, fds[t.dest], progress, cancelled, pager)
                    else:
                        n = _fetch_chunk(client, t, i, chunk, fds[t.dest], progress, cancelled)
                    with t._lock:
                        t._done.add(i)
                        _record(t, chunk)
                        last = len(t._done) == t.nchunks(chunk)
                    with count_lock:
                        fetched += n
                    if last:
                        finish(t)
                except BaseException as exc:  # noqa: BLE001 — the first error stops every worker
                    errors.append(exc)

        threads = [threading.Thread(target=work, name=f"mx-get-{k}", daemon=True)
                   for k in range(max(1, min(workers, tasks.qsize())))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            full = next((e for e in errors if isinstance(e, OSError) and e.errno in FULL), None)
            if full is not None:
                with fds_lock:
                    for mapped in maps.values():
                        mapped.close()
                    maps.clear()
                    for fd in fds.values():
                        os.close(fd)
                    fds.clear()
                _discard(targets)
                folder = targets[0].dest.parent
                raise CheckFailed(f"the disk under {folder} filled up during the download ({os.strerror(full.errno)}); "
                                  "its partial files were removed", "free space there, or point HF_HUB_CACHE / "
                                  "--artifact-path at a filesystem with room, and run it again")
            raise errors[0]
        return fetched
    finally:
        with fds_lock:
            for mapped in maps.values():
                mapped.close()
            for fd in fds.values():
                os.close(fd)


def _fetch_direct(conns: direct.Conns, t: Target, i: int, chunk: int, mapped: FileMapping, fd: int,
                  progress: Callable[[int], None], cancelled: Callable[[], bool], pager: Optional[HugePager]) -> int:
    """`_fetch_chunk` over remote/direct.py: the chunk read straight into the file's mapping."""
    start = i * chunk
    want = min(t.size, start + chunk) - start
    ranged = t.size > chunk or i > 0
    last: Optional[BaseException] = None
    for attempt in range(TRIES):
        if cancelled():
            raise DownloadCancelled(f"the download of {_shown(t.url)} was stopped", "run the launch again: it resumes")
        counted = [0]

        def seen(n: int) -> None:
            counted[0] += n
            progress(n)

        view = mapped.view[start:start + want]
        try:
            if pager is not None and attempt == 0:
                pager.prepare(mapped, fd, start, start + want)  # ENOSPC here is a full disk, as below
            return direct.read_range(conns, t.url, start, view, fd, ranged, seen, cancelled)
        except direct.Refused as exc:
            if exc.ignored_range:
                raise CheckFailed(f"{_shown(t.url)} ignored the byte range (HTTP {exc.status})",
                                  "use a server that serves byte ranges (S3 and its peers do)") from exc
            raise CheckFailed(f"{_shown(t.url)} answered HTTP {exc.status}", t.refused_fix) from exc
        except InterruptedError as exc:
            raise DownloadCancelled(f"the download of {_shown(t.url)} was stopped", "run the launch again: it resumes") from exc
        except OSError as exc:
            if exc.errno in FULL:
                raise
            last = exc
        except http.client.HTTPException as exc:
            last = exc
        finally:
            view.release()
        direct.drop(conns, t.url)
        progress(-counted[0])
        time.sleep(0.2 * (attempt + 1))
    raise CheckFailed(f"the download of {_shown(t.url)} failed {TRIES} times ({type(last).__name__}: {last})",
                      "check the connection to the server and run it again: it resumes where it stopped")


def _fetch_chunk(client: httpx.Client, t: Target, i: int, chunk: int, fd: int,
                 progress: Callable[[int], None], cancelled: Callable[[], bool]) -> int:
    start = i * chunk
    end = min(t.size, start + chunk) - 1
    want = end - start + 1
    last: Optional[BaseException] = None
    for attempt in range(TRIES):
        if cancelled():
            raise DownloadCancelled(f"the download of {_shown(t.url)} was stopped", "run the launch again: it resumes")
        got = 0
        try:
            ranged = t.size > chunk or i > 0
            hdrs = {"range": f"bytes={start}-{end}"} if ranged else {}
            with client.stream("GET", t.url, headers=hdrs) as resp:
                if resp.status_code >= 400:
                    raise CheckFailed(f"{_shown(t.url)} answered HTTP {resp.status_code}", t.refused_fix)
                if ranged and resp.status_code != 206:
                    raise CheckFailed(f"{_shown(t.url)} ignored the byte range (HTTP {resp.status_code})",
                                      "use a server that serves byte ranges (the hub and its CDN do)")
                pos = start
                for data in resp.iter_bytes():  # as the socket delivers: no re-chunking copy
                    if cancelled():
                        raise DownloadCancelled(f"the download of {_shown(t.url)} was stopped", "run the launch again: it resumes")
                    if len(data) > want - got:  # a server that sends past the range
                        data = data[: want - got]
                    os.pwrite(fd, data, pos)
                    pos += len(data)
                    got += len(data)
                    progress(len(data))
                    if got >= want:
                        break
            if got != want:
                raise httpx.ReadError(f"got {got} of {want} bytes")
            return got
        except (httpx.TransportError, httpx.ReadError) as exc:
            progress(-got)
            last = exc
            time.sleep(0.2 * (attempt + 1))
    raise CheckFailed(f"the download of {_shown(t.url)} failed {TRIES} times ({type(last).__name__}: {last})",
                      "check the connection to the hub and run the launch again: it resumes where it stopped")


def _shown(url: str) -> str:
    """A URL for a message: without its query (a presigned URL's query holds its signature)."""
    return url.split("?", 1)[0]
