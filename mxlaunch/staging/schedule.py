"""Which byte range to read next: cut files into chunks and hand them out so no device starves.

Without Lustre every chunk targets one local device and goes out in file order — the first file
completes first, so a consumer (the engine's loader) can start on it while later files arrive.
With Lustre layouts, chunks are cut at stripe boundaries so each touches one OST, and the next chunk
goes to the OST with the fewest requests in flight, under a per-OST depth bound, earliest file first.
The bound is the readers shared by the OSTs that still have chunks to hand out: an OST needs many
requests in flight to reach its ceiling (scripts/bench_ost_model.py), so when the last files' OSTs are
all that is left, they get every reader.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from mxlaunch.staging.lustre import Layout

LOCAL_TARGET = "local"
READERS_PER_OST = 8  # requests in flight an OST is given when the reader count is left to mxlaunch
MAX_READERS = 128


def readers_for_layouts(readers: int, layouts: list[Layout | None] | None) -> int:
    """Readers for files with these Lustre layouts when the user did not choose: READERS_PER_OST for each
    OST the files sit on, between `readers` (the default) and MAX_READERS. An OST's bandwidth grows with
    requests in flight (servekit saw one still rising at 64 streams; the OST model's B(n) = C(1−2^(−n/n½))
    gives 0.94 C at 8 when n½ = 2), so 32 readers over 8 OSTs (4 each) leave a quarter of every OST idle.
    Off Lustre (no layouts), `readers` as given."""
    osts = {ost for layout in layouts or [] if layout is not None for ost in layout.ost_set}
    if not osts:
        return readers
    return max(readers, min(MAX_READERS, READERS_PER_OST * len(osts)))


@dataclass(frozen=True)
class Chunk:
    """A byte range of one file, and the device (OST) that serves it."""

    file_index: int
    offset: int
    length: int
    target: str


def cut_chunks(sizes: list[int], chunk_size: int, layouts: list[Layout | None] | None = None) -> list[Chunk]:
    """Split files into chunks of at most `chunk_size` (a multiple of 4096), stripe-aligned on Lustre."""
    if chunk_size <= 0 or chunk_size % 4096:
        raise ValueError("chunk size must be a positive multiple of 4096")
    chunks: list[Chunk] = []
    for index, size in enumerate(sizes):
        layout = layouts[index] if layouts else None
        offset = 0
        while offset < size:
            end = min(size, offset + chunk_size)
            target = LOCAL_TARGET
            if layout is not None:
                end = min(end, layout.stripe_end(offset))
                ost = layout.ost_for(offset)
                target = f"ost{ost}" if ost is not None else LOCAL_TARGET
            chunks.append(Chunk(index, offset, end - offset, target))
            offset = end
    return chunks


class ChunkScheduler:
    """Thread-safe hand-out of chunks: bounded in flight per target (OST) and per file.

    The per-file bound spreads readers over a few files at once — writes into one tmpfs file
    serialize on its inode lock — while file order still decides who goes first.
    """

    def __init__(self, chunks: list[Chunk], readers: int, depth_per_target: int | None = None,
                 per_file: int | None = None) -> None:
        self._pending: dict[str, dict[int, deque[Chunk]]] = {}
        for chunk in chunks:
            self._pending.setdefault(chunk.target, {}).setdefault(chunk.file_index, deque()).append(chunk)
        targets = max(1, len(self._pending))
        self.readers = readers
        self.fixed_depth = depth_per_target  # None: the readers are shared by the targets that still have work
        self.depth = depth_per_target or max(1, math.ceil(readers / targets))
        self.per_file = per_file or readers
        self._inflight: dict[str, int] = {t: 0 for t in self._pending}
        self._file_inflight: dict[int, int] = {}
        self._left = len(chunks)
        self._cond = threading.Condition()
        self._closed = False

    def _pick(self) -> tuple[str, int] | None:
        best: tuple[int, int, int] | None = None
        choice = None
        if self.fixed_depth is None:  # an OST whose chunks are all taken frees its share for the others
            with_work = sum(1 for files in self._pending.values() if files)
            self.depth = max(1, math.ceil(self.readers / max(1, with_work)))
        for target, files in self._pending.items():
            if not files:
                continue
            if self._inflight[target] >= self.depth:
                continue
            for file_index, queue in files.items():
                if self._file_inflight.get(file_index, 0) >= self.per_file:
                    continue
                head = queue[0]
                key = (self._inflight[target], head.file_index, head.offset)
                if best is None or key < best:
                    best, choice = key, (target, file_index)
                break  # later files of this target only matter when earlier ones are capped
        return choice

    def take(self) -> Chunk | None:
        """Next chunk to read, blocking while every target with work is at its bound; None when done."""
        with self._cond:
            while True:
                if self._closed or self._left == 0:
                    return None
                choice = self._pick()
                if choice is not None:
                    target, file_index = choice
                    files = self._pending[target]
                    chunk = files[file_index].popleft()
                    if not files[file_index]:
                        del files[file_index]
                    self._inflight[target] += 1
                    self._file_inflight[file_index] = self._file_inflight.get(file_index, 0) + 1
                    self._left -= 1
                    return chunk
                self._cond.wait()

    def done(self, chunk: Chunk) -> None:
        with self._cond:
            self._inflight[chunk.target] -= 1
            self._file_inflight[chunk.file_index] -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop handing out work (cancel / error): every waiting reader wakes and gets None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def order(self) -> list[Chunk]:
        """Drain the schedule single-threaded with `depth` slots per target, for tests and dry runs."""
        taken: list[Chunk] = []
        inflight: deque[Chunk] = deque()
        while True:
            with self._cond:
                target = None if self._left == 0 else self._pick()
            if target is None:
                if not inflight:
                    return taken
                self.done(inflight.popleft())
                continue
            chunk = self.take()
            assert chunk is not None
            taken.append(chunk)
            inflight.append(chunk)
