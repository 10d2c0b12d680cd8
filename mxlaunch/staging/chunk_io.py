"""How one chunk's bytes reach the destination, per write mode (mmap, pwrite, procs): StageJob's readers.

A mixin of StageJob (staging/reader.py): the methods use its files, pager, options and chunk loop.
O_DIRECT where the filesystem takes it, buffered reads where it refuses them (once per file).
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys

from mxlaunch import settings
from mxlaunch.staging.records import _O_DIRECT, ALIGN, WORKER, _FileState, _prefault
from mxlaunch.staging.schedule import Chunk


class ChunkReader:
    """The reader side of StageJob: open sources, move chunks, drive reader processes."""

    def _open_source(self, state: _FileState) -> int:
        with state.lock:
            if state.src_fd is None:
                fd = -1
                if self.use_o_direct:
                    try:
                        fd = os.open(state.item.src, os.O_RDONLY | _O_DIRECT)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                if fd < 0:
                    fd = os.open(state.item.src, os.O_RDONLY)
                    state.o_direct = False
                state.src_fd = fd
            return state.src_fd

    def _fall_back_to_buffered(self, state: _FileState) -> int:
        """The filesystem took O_DIRECT at open but refuses the reads: reopen buffered, once."""
        with state.lock:
            if state.o_direct:
                old = state.src_fd
                state.src_fd = os.open(state.item.src, os.O_RDONLY)
                state.o_direct = False
                if old is not None:
                    os.close(old)
            assert state.src_fd is not None
            return state.src_fd

    def _read_into(self, fd: int, view: memoryview, offset: int, state: _FileState) -> None:
        """Fill `view` from `offset`; short reads continue; EOF before the end is an error."""
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise OSError(errno.EIO, f"{state.item.src} ended at {offset + got} bytes, expected "
                              f"{state.item.size} (did it change while staging?)")
            got += n

    def _collapse(self, state: _FileState, chunk: Chunk) -> None:
        """Give the chunk's whole 2 MiB blocks one huge page each before any byte lands there."""
        if state.mapping is not None and state.dest_fd is not None:
            self._pager.prepare(state.mapping, state.dest_fd, chunk.offset, chunk.offset + chunk.length)

    def _read_chunk(self, chunk: Chunk, bounce: mmap.mmap) -> None:
        state = self._files[chunk.file_index]
        fd = self._open_source(state)
        if self.write_mode != "mmap":
            self._read_chunk_via_buffer(chunk, state, fd, bounce)
            return
        assert state.mapping is not None
        self._collapse(state, chunk)
        view = state.mapping.view[chunk.offset : chunk.offset + chunk.length]
        try:
            direct_len = chunk.length - (chunk.length % ALIGN) if state.o_direct else chunk.length
            try:
                if direct_len:
                    self._read_into(fd, view[:direct_len], chunk.offset, state)
                tail = chunk.length - direct_len
                if tail:  # the last partial block of a file: aligned read into a bounce buffer
                    n = os.preadv(fd, [memoryview(bounce)[:ALIGN]], chunk.offset + direct_len)
                    if n < tail:
                        raise OSError(errno.EIO, f"{state.item.src} is shorter than {state.item.size} bytes")
                    view[direct_len:] = bounce[:tail]
            except OSError as exc:
                if exc.errno != errno.EINVAL or not state.o_direct:
                    raise
                fd = self._fall_back_to_buffered(state)
                self._read_into(fd, view, chunk.offset, state)
        finally:
            view.release()

    def _read_chunk_via_buffer(self, chunk: Chunk, state: _FileState, fd: int, buf: mmap.mmap) -> None:
        """O_DIRECT into this thread's aligned buffer (length rounded up to 4 KiB), then pwrite."""
        padded = -(-chunk.length // ALIGN) * ALIGN
        view = memoryview(buf)
        try:
            try:
                got = 0
                while got < chunk.length:
                    n = os.preadv(fd, [view[got:padded]], chunk.offset + got)
                    if n == 0:
                        raise OSError(errno.EIO, f"{state.item.src} ended at {chunk.offset + got} bytes, "
                                      f"expected {state.item.size} (did it change while staging?)")
                    got += n
            except OSError as exc:
                if exc.errno != errno.EINVAL or not state.o_direct:
                    raise
                fd = self._fall_back_to_buffered(state)
                self._read_into(fd, view[: chunk.length], chunk.offset, state)
            assert state.dest_fd is not None
            self._collapse(state, chunk)
            done = 0
            while done < chunk.length:
                done += os.pwrite(state.dest_fd, view[done : chunk.length], chunk.offset + done)
        finally:
            view.release()

    def _reader_loop(self) -> None:
        if self.write_mode == "procs":
            self._worker_loop()
            return
        size = self.chunk_size if self.write_mode == "pwrite" else ALIGN
        bounce = mmap.mmap(-1, size)
        if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE") and not settings.no_thp():
            # 2 MiB pages: O_DIRECT pins the buffer per folio, not per 4 KiB page — less kernel CPU.
            try:
                bounce.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        _prefault(bounce)
        try:
            self._run_chunks(lambda chunk: self._read_chunk(chunk, bounce))
        except BaseException as exc:  # noqa: BLE001 — any failure stops the whole job
            # Drop the traceback: its frames hold views into the destination mmaps.
            self._fail(exc.with_traceback(None))
        finally:
            bounce.close()

    def _worker_loop(self) -> None:
        """One reader thread driving one reader process over pipes (the thread only waits)."""
        worker = None
        try:
            worker = subprocess.Popen([sys.executable, "-S", "-I", str(WORKER), str(self.chunk_size)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            self._run_chunks(lambda chunk: self._read_via_worker(worker, chunk))
        except BaseException as exc:  # noqa: BLE001 — any failure stops the whole job
            self._fail(exc.with_traceback(None))
        finally:
            if worker is not None:
                try:
                    worker.stdin.close()  # type: ignore[union-attr]
                    worker.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired, ValueError):
                    worker.kill()
                    worker.wait()

    def _read_via_worker(self, worker: subprocess.Popen, chunk: Chunk) -> None:
        state = self._files[chunk.file_index]
        assert worker.stdin is not None and worker.stdout is not None
        self._collapse(state, chunk)  # the mapping lives here; the worker's pwrite lands in the huge pages
        worker.stdin.write(f"{state.item.src}\t{state.partial}\t{chunk.offset}\t{chunk.length}\t"
                           f"{int(state.o_direct and self.use_o_direct)}\n")
        answer = worker.stdout.readline().rstrip("\n").split("\t")
        if answer[0] == "ok":
            if answer[1] == "0":
                state.o_direct = False
        elif answer[0] == "err":
            raise OSError(int(answer[1]), answer[2] if len(answer) > 2 else "read failed", str(state.item.src))
        else:
            raise OSError(errno.EIO, "a reader process died", str(state.item.src))
