"""`mxlaunch stage`: sources → layouts → parallel copy → optional manifest, as one call.

The launch pipeline uses StageJob directly (it needs per-file events); this module is the
command-line shape of the same engine.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mxlaunch.signal_relay import SignalRelay
from mxlaunch.staging.lustre import layout_of
from mxlaunch.staging.manifest import read_manifest, write_manifest
from mxlaunch.staging.reader import DEFAULT_CHUNK, StageCancelled, StageJob, StageResult
from mxlaunch.staging.sources import CopyItem, expand_sources


def default_readers() -> int:
    """32 requests in flight: with reads landing straight in 2 MiB destination pages a reader thread
    costs almost nothing but its request, and 32 (8 per file) was the best median on the 2×H200
    host's disk (docs/benchmarks.md, 2026-11-30). Lustre clients with many OSTs may want more."""
    return 32


def default_per_file(readers: int, write_mode: str = "mmap") -> int:
    """Reads in flight per file. mmap mode: readers/4 (8 at 32) — reads into collapsed 2 MiB pages
    do not serialize on the file, they only need depth. pwrite/procs: readers/8 — their tmpfs writes
    into one file serialize on its inode lock, so more waiters only burn CPU (per-file 4 → 2 cut
    CPU/GiB 0.81 → 0.71 on the 2×H200 host at the same speed). Either way the first file lands first."""
    return max(1, readers // (4 if write_mode == "mmap" else 8))


@dataclass
class StageRequest:
    sources: list[str]
    dest: Path
    readers: int
    chunk_size: int = DEFAULT_CHUNK
    manifest: Path | None = None
    write_manifest: Path | None = None
    verify: bool = False
    rate_limit: float | None = None
    overwrite: bool = False
    use_o_direct: bool = True
    write_mode: str = "mmap"
    per_file: int | None = None
    huge_pages: bool = True


def plan_items(request: StageRequest) -> tuple[list[CopyItem], list]:
    """Expand sources and read Lustre layouts (None per file where there is no Lustre)."""
    items = expand_sources(request.sources)
    layouts = [layout_of(item.src) for item in items]
    return items, layouts


def run_stage(
    request: StageRequest,
    items: list[CopyItem],
    layouts: list,
    on_progress: Callable[[int], None] | None = None,
) -> StageResult:
    """Run the copy in the foreground; SIGINT/SIGTERM cancel it and clean up before we exit."""
    expected = read_manifest(request.manifest) if request.manifest else None
    job = StageJob(
        items,
        request.dest,
        readers=request.readers,
        chunk_size=request.chunk_size,
        layouts=layouts if any(layouts) else None,
        expected=expected,
        verify_source=request.verify,
        want_hashes=request.write_manifest is not None,
        rate_limit=request.rate_limit,
        overwrite=request.overwrite,
        use_o_direct=request.use_o_direct,
        write_mode=request.write_mode,
        per_file=request.per_file or default_per_file(request.readers, request.write_mode),
        huge_pages=request.huge_pages,
        on_progress=on_progress,
    )
    # job.cancel() takes locks: it runs in the relay's thread, never in the handler (signal_relay.py)
    with SignalRelay((signal.SIGINT, signal.SIGTERM), deferred=lambda _s: job.cancel()) as relay:
        received = relay.received
        job.start()
        try:
            result = job.wait()
        except StageCancelled as exc:
            if received:
                exc.exit_code = 128 + received[0]
                exc.message = f"staging interrupted by {signal.Signals(received[0]).name}; nothing was left behind"
            raise
    if request.write_manifest:
        write_manifest(
            request.write_manifest,
            {f.rel: {"bytes": f.bytes, "xxh3_128": f.xxh3_128} for f in result.files},
        )
    return result
