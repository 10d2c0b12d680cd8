"""Parallel positional reads straight into the destination: the staging engine.

Reader threads take chunks from the scheduler and `os.preadv` them (the GIL is released during the
syscall) with O_DIRECT into a shared mapping of `<dest>.partial`, so each byte is copied once: disk →
destination page. Where the destination is tmpfs, each chunk's 2 MiB blocks are first collapsed into
huge pages (hugepages.py), which takes the per-4-KiB page cost — the CPU floor of staging — away.
A file appears under its final name by rename only when every chunk is in (and its checksum matched,
when one was asked for); the rename is the ready signal for consumers, and `StageJob.completed()`
reports the same events in-process. On error or cancel, readers stop and every file and folder this
job created is removed. How a chunk's bytes move per write mode: staging/chunk_io.py; the records and
small helpers: staging/records.py.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import xxhash

from mxlaunch.errors import CheckFailed, MxlaunchError, UsageError
from mxlaunch.staging.capacity import capacity_of, format_bytes, tmpfs_pager
from mxlaunch.memory.hugepages import HUGE, FileMapping, HugePager
from mxlaunch.staging.lustre import Layout
from mxlaunch.staging.ost_model import OstModel
from mxlaunch.staging.schedule import Chunk, ChunkScheduler, cut_chunks
from mxlaunch.staging.chunk_io import ChunkReader
from mxlaunch.staging.records import (  # noqa: F401 — callers import these from here
    _O_DIRECT, ALIGN, DEFAULT_CHUNK, WORKER, WRITE_MODES, StageCancelled, StagedFile, StageResult, _FileState,
    _RateLimiter)
from mxlaunch.staging.sources import PARTIAL_SUFFIX, CopyItem
from mxlaunch.store.snapshot import xxh3_file

class StageJob(ChunkReader):
    """Copy `items` into `dest` with `readers` threads; observe files as they complete.

    Typical use (the launch pipeline):
        job = StageJob(items, dest, readers=32).start()
        for staged in job.completed():   # yields each file right after its rename
            ...
        result = job.wait()              # raises on failure (after cleaning up)
    """

    def __init__(
        self,
        items: list[CopyItem],
        dest: str | os.PathLike[str],
        *,
        readers: int = 32,
        chunk_size: int = DEFAULT_CHUNK,
        layouts: list[Layout | None] | None = None,
        expected: dict[str, dict] | None = None,
        verify_source: bool = False,
        want_hashes: bool = False,
        rate_limit: float | None = None,
        overwrite: bool = False,
        reserve_bytes: int = 0,
        use_o_direct: bool = True,
        write_mode: str = "mmap",
        per_file: int | None = None,
        huge_pages: bool = True,
        on_progress: Callable[[int], None] | None = None,
        ost_model: OstModel | None = None,
    ) -> None:
        if readers < 1:
            raise UsageError(f"--readers must be ≥ 1, got {readers}", "pass a positive reader count")
        if chunk_size < ALIGN or chunk_size % ALIGN:
            raise UsageError(
                f"chunk size {chunk_size} is not a multiple of 4 KiB", "use e.g. --chunk-size 16MiB"
            )
        self.items = items
        self.dest = Path(dest)
        self.readers = readers
        self.chunk_size = chunk_size
        self.layouts = layouts
        self.expected = expected
        self.verify_source = verify_source
        self.want_hashes = want_hashes or expected is not None or verify_source
        self.overwrite = overwrite
        self.reserve_bytes = reserve_bytes
        self.use_o_direct = use_o_direct and bool(_O_DIRECT)
        if write_mode not in WRITE_MODES:
            raise UsageError(f"write mode {write_mode!r} is not one of {', '.join(WRITE_MODES)}")
        self.write_mode = write_mode
        if per_file is not None and per_file < 1:
            raise UsageError(f"--per-file must be ≥ 1, got {per_file}", "pass a positive count or leave it out")
        self.per_file = per_file
        self.huge_pages = huge_pages
        self._pager = HugePager(enabled=False)
        self.on_progress = on_progress
        self.ost_model = ost_model  # tests and benchmarks only (staging/ost_model.py): each chunk held to its OSTs
        self._cancel = threading.Event()
        self._limiter = _RateLimiter(rate_limit, self._cancel) if rate_limit else None
        self._events: queue.Queue[StagedFile | None] = queue.Queue()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._files: list[_FileState] = []
        self._finished: list[StagedFile] = []
        self._created_dirs: list[Path] = []
        self._created_files: list[Path] = []
        self._t0 = 0.0
        self._done = threading.Event()
        self._result: StageResult | None = None

    # ---- checks before any byte moves -----------------------------------------------------------

    def total_bytes(self) -> int:
        return sum(item.size for item in self.items)

    def preflight(self) -> None:
        """Refuse what cannot work before creating anything: clashes, capacity, manifest mismatch."""
        for item in self.items:
            final = self.dest / item.rel
            if final.exists() and not self.overwrite:
                raise UsageError(f"{final} already exists", "remove it or pass --overwrite")
            if Path(str(final) + PARTIAL_SUFFIX).exists():
                raise UsageError(f"{final}{PARTIAL_SUFFIX} exists (another stage running?)", "remove it and retry")
        if self.expected is not None:
            for item in self.items:
                entry = self.expected.get(item.rel)
                if entry is None:
                    raise CheckFailed(f"{item.rel} is not in the manifest", "pass the manifest written for these files")
                if int(entry.get("bytes", -1)) != item.size:
                    raise CheckFailed(
                        f"{item.rel} is {item.size} bytes but the manifest says {entry.get('bytes')}",
                        "the source changed since the manifest was written; re-create it with --write-manifest",
                    )
        need = self.total_bytes() + self.reserve_bytes
        cap = capacity_of(self.dest)
        if need > cap.usable:
            reserve = f" (+{format_bytes(self.reserve_bytes)} reserved)" if self.reserve_bytes else ""
            raise UsageError(
                f"staging needs {format_bytes(self.total_bytes())}{reserve} but {cap.binding_limit} "
                f"leaves {format_bytes(cap.usable)}",
                "free space, raise the job's memory limit, or stage to another --dest",
            )

    # ---- running ---------------------------------------------------------------------------------

    def start(self) -> "StageJob":
        self.preflight()
        self._t0 = time.perf_counter()
        try:
            self._prepare_files()
        except BaseException:
            self._cleanup()
            raise
        sizes = [state.item.size for state in self._files]
        scheduler = ChunkScheduler(cut_chunks(sizes, self.chunk_size, self.layouts), self.readers,
                                   per_file=self.per_file)
        self._scheduler = scheduler
        try:
            for state in self._files:
                if state.item.size == 0:
                    self._finish_file(state)
        except BaseException:
            self._cleanup()
            raise
        for n in range(self.readers):
            thread = threading.Thread(target=self._reader_loop, name=f"mx-reader-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        threading.Thread(target=self._supervise, name="mx-stage-supervisor", daemon=True).start()
        return self

    def _mkdirs(self, path: Path) -> None:
        missing: list[Path] = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        for folder in reversed(missing):
            folder.mkdir()
            self._created_dirs.append(folder)

    def _prepare_files(self) -> None:
        self._mkdirs(self.dest)
        pager = tmpfs_pager(self.dest, lands_in_mapping=self.write_mode == "mmap") if self.huge_pages else None
        if pager is not None:
            self._pager = pager
        elif self.huge_pages:
            self._pager.reason = "the destination is not tmpfs"
        for item in self.items:
            final = self.dest / item.rel
            self._mkdirs(final.parent)
            partial = Path(str(final) + PARTIAL_SUFFIX)
            state = _FileState(item=item, dest=final, partial=partial, remaining=item.size)  # bytes to read
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            self._created_files.append(partial)
            state.dest_fd = fd
            if item.size:
                os.ftruncate(fd, item.size)
                if self.write_mode == "mmap" or (self._pager.enabled and item.size >= HUGE):
                    state.mapping = FileMapping(fd, item.size)
            self._files.append(state)

    def _run_chunks(self, read: Callable[[Chunk], None]) -> None:
        """Take chunks until none are left (or the job stops); `read` moves one chunk's bytes."""
        while not self._cancel.is_set():
            chunk = self._scheduler.take()
            if chunk is None:
                return
            try:
                if self._limiter:
                    self._limiter.acquire(chunk.length)
                if self._cancel.is_set():
                    return
                if self.ost_model is None:
                    read(chunk)
                elif not self._read_modelled(chunk, read):
                    return
            finally:
                self._scheduler.done(chunk)
            if self.on_progress:
                self.on_progress(chunk.length)
            state = self._files[chunk.file_index]
            with state.lock:  # bytes, not chunks: the scheduler may hand an OST's last chunks out in pieces
                state.remaining -= chunk.length
                last = state.remaining == 0
            if last:
                self._finish_file(state)

    def _read_modelled(self, chunk: Chunk, read: Callable[[Chunk], None]) -> bool:
        """Read a chunk inside its modelled OST transfer (tests and benchmarks): the bytes move while
        the model holds the request, as a real read's arrive during it. False: cancelled, not read."""
        assert self.ost_model is not None
        with self.ost_model.transfer(chunk.file_index, chunk.offset, chunk.length):
            if self._cancel.is_set():
                return False
            read(chunk)
        return True

    def _finish_file(self, state: _FileState) -> None:
        digest = None
        if self.want_hashes:
            digest = self._hash_dest(state)
        if self.expected is not None:
            want = self.expected[state.item.rel].get("xxh3_128")
            if want and want != digest:
                raise CheckFailed(
                    f"{state.item.rel}: checksum {digest} does not match the manifest's {want}",
                    "the source is corrupt or changed; re-stage from a good copy",
                )
        if self.verify_source and state.item.size:
            src_digest = xxh3_file(state.item.src)
            if src_digest != digest:
                raise CheckFailed(f"{state.item.rel}: copy differs from its source", "re-run the stage")
        self._close_file(state)
        os.rename(state.partial, state.dest)
        with self._error_lock:
            self._created_files.remove(state.partial)
            self._created_files.append(state.dest)
            state.done = True
        staged = StagedFile(
            src=state.item.src,
            dest=state.dest,
            rel=state.item.rel,
            bytes=state.item.size,
            seconds=time.perf_counter() - self._t0,
            o_direct=state.o_direct if state.item.size else True,
            xxh3_128=digest,
        )
        self._finished.append(staged)
        self._events.put(staged)

    def _hash_dest(self, state: _FileState) -> str:
        if state.item.size == 0:
            return xxhash.xxh3_128().hexdigest()
        if state.mapping is not None:
            return xxhash.xxh3_128(state.mapping.view).hexdigest()
        assert state.dest_fd is not None
        with mmap.mmap(state.dest_fd, state.item.size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped:
            return xxhash.xxh3_128(mapped).hexdigest()

    def _close_file(self, state: _FileState) -> None:
        if state.mapping is not None:
            state.mapping.close()  # only once no reader uses this file (its last chunk is in, or all joined)
            state.mapping = None
        for attr in ("src_fd", "dest_fd"):
            fd = getattr(state, attr)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(state, attr, None)

    def _fail(self, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = exc
        self._cancel.set()
        self._scheduler.close()

    def _supervise(self) -> None:
        try:
            self._settle()
        except BaseException as exc:  # noqa: BLE001 — wait() must always return
            with self._error_lock:
                self._error = self._error or exc
            self._result = None
            try:
                self._cleanup()
            except OSError:
                pass
        finally:
            self._events.put(None)
            self._done.set()

    def _settle(self) -> None:
        for thread in self._threads:
            thread.join()
        seconds = time.perf_counter() - self._t0
        if self._error is not None or self._cancel.is_set():
            self._cleanup()
        else:
            order = {item.rel: n for n, item in enumerate(self.items)}
            files = sorted(self._finished, key=lambda f: order[f.rel])
            self._result = StageResult(
                files=files,
                bytes=self.total_bytes(),
                seconds=seconds,
                readers=self.readers,
                chunk_size=self.chunk_size,
                o_direct=all(f.o_direct for f in files),
                huge_bytes=self._pager.collapsed,
                huge_note=self._pager.reason,
            )

    def _cleanup(self) -> None:
        """Remove every file and folder this job created (partials and completed ones alike)."""
        for state in self._files:
            self._close_file(state)
        for path in reversed(self._created_files):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self._created_files.clear()
        for folder in reversed(self._created_dirs):
            try:
                folder.rmdir()
            except OSError:
                pass
        self._created_dirs.clear()

    # ---- observing ------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop readers and remove what was written; wait() then raises StageCancelled."""
        self._cancel.set()
        if hasattr(self, "_scheduler"):
            self._scheduler.close()

    def completed(self) -> Iterator[StagedFile]:
        """Yield each file as soon as it is complete under its final name, until the job ends."""
        while True:
            event = self._events.get()
            if event is None:
                self._events.put(None)  # let other iterators / wait() see the end too
                return
            yield event

    def finished(self, timeout: float) -> bool:
        """Has the job ended (readers joined, files settled)? Waits up to `timeout` seconds."""
        return self._done.wait(timeout)

    def wait(self, poll: float = 0.2) -> StageResult:
        """Block until done (waking often so signal handlers run); raise on failure or cancel."""
        while not self._done.wait(poll):
            pass
        if self._error is not None:
            err = self._error
            if isinstance(err, MxlaunchError):
                raise err
            if isinstance(err, OSError):
                where = f" ({err.filename})" if err.filename else ""
                raise CheckFailed(
                    f"staging failed: {err.strerror or err}{where}; nothing was left behind",
                    "check the source files and the destination, then retry",
                ) from err
            raise CheckFailed(f"staging failed: {err!r}; nothing was left behind") from err
        if self._result is None:
            raise StageCancelled("staging interrupted; nothing was left behind")
        return self._result


def stage(items: list[CopyItem], dest: str | os.PathLike[str], **kwargs) -> StageResult:
    """Copy and wait: the one-call form of StageJob."""
    return StageJob(items, dest, **kwargs).start().wait()
