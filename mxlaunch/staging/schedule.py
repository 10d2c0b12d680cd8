"""Which byte range to read next: cut files into chunks and hand them out so no device starves.

Without Lustre every chunk targets one local device and goes out in file order — the first file
completes first, so a consumer (the engine's loader) can start on it while later files arrive.
With Lustre layouts, chunks are cut at stripe boundaries so each touches one OST, and the next chunk
goes to the OST with the fewest requests in flight, under a per-OST depth bound, earliest file first.
The bound is the readers shared by the OSTs that still have chunks to hand out: an OST needs many
requests in flight to reach its ceiling (scripts/bench/bench_ost_model.py), so when the last files' OSTs are
all that is left, they get every reader. For the same reason an OST's last chunks are handed out in
smaller pieces (2 MiB at the least): its final requests then still fill its depth, instead of a few
whole chunks running alone at the bottom of its curve.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from mxlaunch.staging.lustre import Layout

LOCAL_TARGET = "local"
READERS_PER_OST = 16  # requests in flight an OST is given when the reader count is left to mxlaunch
MAX_READERS = 128
TAIL_PIECE = 2 << 20  # the smallest piece an OST's last chunks are cut to: whole 2 MiB pages, a 2 MiB RPC


def readers_for_layouts(readers: int, layouts: list[Layout | None] | None) -> int:
    """Readers for files with these Lustre layouts when the user did not choose: READERS_PER_OST for each
    OST the files sit on, between `readers` (the default) and MAX_READERS. An OST's bandwidth grows with
    requests in flight (servekit saw one still rising at 64 streams; the OST model's B(n) = C(1−2^(−n/n½))
    gives 0.75 C at 4, 0.94 C at 8, 0.996 C at 16 when n½ = 2): 32 readers over 8 OSTs leave a quarter of
    every OST idle, and 8 per OST leave no room for a run's ramp and tail under 0.9 C. More readers than
    an OST's client allows RPCs in flight (max_rpcs_in_flight, 8 by default) wait in the client: no worse
    than 8. Off Lustre (no layouts), `readers` as given."""
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
        self._pending_bytes: dict[str, int] = {t: 0 for t in self._pending}
        for chunk in chunks:
            self._pending_bytes[chunk.target] += chunk.length
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
                    return self._hand_out(*choice)
                self._cond.wait()

    def _hand_out(self, target: str, file_index: int) -> Chunk:
        """The head chunk of this target and file, or its first piece (the rest stays at the head)."""
        files = self._pending[target]
        chunk = files[file_index].popleft()
        piece = self._tail_piece(chunk)
        if piece < chunk.length:
            files[file_index].appendleft(Chunk(file_index, chunk.offset + piece, chunk.length - piece, target))
            chunk = Chunk(file_index, chunk.offset, piece, target)
        else:
            self._left -= 1
        if not files[file_index]:
            del files[file_index]
        self._pending_bytes[target] -= chunk.length
        self._inflight[target] += 1
        self._file_inflight[file_index] = self._file_inflight.get(file_index, 0) + 1
        return chunk

    def _tail_piece(self, chunk: Chunk) -> int:
        """Bytes of `chunk` to hand out now. Once an OST's bytes not yet handed out are fewer than its
        depth's worth of chunks, each request takes its share of them (pending / depth, in TAIL_PIECEs),
        so the OST's last requests are many and small and end together — not a few whole chunks, each
        alone on the OST at the bottom of its curve. Without Lustre (one local target), whole chunks."""
        if chunk.target == LOCAL_TARGET or chunk.length <= TAIL_PIECE:
            return chunk.length
        share = self._pending_bytes[chunk.target] / self.depth
        if share >= chunk.length:
            return chunk.length
        end = (chunk.offset + max(TAIL_PIECE, math.ceil(share / TAIL_PIECE) * TAIL_PIECE)) // TAIL_PIECE * TAIL_PIECE
        if end <= chunk.offset or end >= chunk.offset + chunk.length:
            return chunk.length  # no 2 MiB boundary inside: the whole chunk
        return end - chunk.offset

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
