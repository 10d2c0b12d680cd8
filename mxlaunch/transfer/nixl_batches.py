"""How a pull's (local, remote) spans are cut into NIXL requests: by memory kind, at most BATCH_BYTES and
BATCH_DESCS a request, long spans chunked — and MXLAUNCH_NIXL_PULL's shape of it (PullConfig). Plain
arithmetic over Pairs with no NIXL import: apart from the agent (transfer/nixl.py), which posts what this
plans, so the cutting is tested and read on its own."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from mxlaunch import settings
from mxlaunch.transfer.tensor_set import Pair

BATCH_BYTES = 4 << 30  # one READ request moves at most this much (the deadline is checked between polls)
BATCH_DESCS = 8192


@dataclass(frozen=True)
class PullConfig:
    """How a pull posts its READs (MXLAUNCH_NIXL_PULL); None: the built-in default.
    prepped: prepare both descriptor lists once per pull (prep_xfer_dlist) and make each request from
             them by index (make_prepped_xfer), instead of initialize_xfer per request;
    merge:   prepped only — let NIXL merge runs of equal-length, back-to-back descriptors into one copy
             (its default; merge=0 passes skip_desc_merge, which keeps chunked spans apart);
    chunk_mib: cut spans longer than this into pieces (0: never); inflight: requests posted at once;
    batch_mib: bytes one request moves when inflight is 1 (0: no limit; default BATCH_BYTES)."""

    prepped: bool = False
    merge: bool = True
    chunk_mib: int | None = None
    inflight: int | None = None
    batch_mib: int | None = None

    @classmethod
    def from_env(cls, environ=os.environ) -> "PullConfig":
        return cls(**settings.nixl_pull(environ))


def split(pairs: Iterable[Pair], chunk: int) -> list[Pair]:
    """Spans longer than `chunk` bytes cut into pieces (each piece its own copy)."""
    out = []
    for p in pairs:
        for off in range(0, p.bytes, chunk):
            out.append(Pair(p.name, p.local_addr + off, p.remote_addr + off, min(chunk, p.bytes - off), p.local_dev,
                            p.remote_dev, p.local_kind, p.remote_kind))
    return out


def groups(pairs: Iterable[Pair]) -> dict[tuple[str, str], list[Pair]]:
    """Pairs by (local, remote) memory kind, in order: one request never mixes kinds."""
    by_kind: dict[tuple[str, str], list[Pair]] = {}
    for p in pairs:
        by_kind.setdefault((p.local_kind, p.remote_kind), []).append(p)
    return by_kind


def ranges(by_kind: dict[tuple[str, str], list[Pair]],
           limit: int | None = None) -> Iterable[tuple[tuple[str, str], int, int]]:
    """(group, start, end) of each batch: at most `limit` (BATCH_BYTES) bytes and BATCH_DESCS pairs."""
    limit = limit or BATCH_BYTES
    for key, group in by_kind.items():
        lo, size = 0, 0
        for i, p in enumerate(group):
            if i > lo and (size + p.bytes > limit or i - lo >= BATCH_DESCS):
                yield key, lo, i
                lo, size = i, 0
            size += p.bytes
        if lo < len(group):
            yield key, lo, len(group)


def batches(pairs: Iterable[Pair], limit: int | None = None) -> Iterable[list[Pair]]:
    """Pairs grouped by memory kinds, each batch at most `limit` (BATCH_BYTES) bytes and BATCH_DESCS."""
    by_kind = groups(pairs)
    for key, lo, hi in ranges(by_kind, limit):
        yield by_kind[key][lo:hi]
