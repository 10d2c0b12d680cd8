"""Engine-neutral core of the in-engine plugin: capture a model's raw tensors, restore them from files.

Torch lives here (and in the engine adapters next to it), never in the launcher. Nothing in this module
knows vLLM or SGLang: an adapter hands it named tensors — a module's parameters and persistent buffers,
aliases included — and gets back files, byte counts and precise errors.

    targets = module_tensors(model)                      # [(name, tensor)], tied names included
    capture_tensors(targets, out_dir)                    # → part-00000.safetensors, ... (temp + rename)
    restore_tensors(targets, files, wait_timeout_s=600)  # wait for each file, copy in, check the fill

The pieces: plugin/tensors.py (storage groups, errors), plugin/snapshot_files.py (the safetensors parts),
plugin/capture.py (writing them), this module (restoring them), plugin/gpu_restore.py (the pinned path to
a GPU). Restore checks that every storage group of the target is filled exactly once, with the file's
shape and dtype, that no file holds a name the target lacks, and that aliases the snapshot recorded are
tied in the target too.

**Restore** reads with `os.preadv` straight into a CPU destination's memory (one copy, measured 2.3×
faster than `safe_open` + `copy_` on tmpfs), from a few threads. Contiguous CUDA destinations go through
pinned host memory (gpu_restore + cuda_copier: registered staged files plus a ring of pinned buffers, at the link's
speed); anything else (strided) gets `dest.copy_(source)` from a read-only mmap of the file. Errors carry
`landed`: False when no byte of any destination was written yet — the caller may still fall back to
another loader — True otherwise (the model is partial: stop, never serve it).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from mxlaunch import settings
from mxlaunch.plugin import host_pages
from mxlaunch.plugin.capture import CaptureResult, capture_tensors
from mxlaunch.plugin.scratch_landing import ScratchLanding
from mxlaunch.plugin.snapshot_files import (
    ALIASES_KEY, MAX_HEADER, PART_BYTES, PART_NAME, SCHEMA_KEY, FileEntry, FileHeader, read_header,
)
from mxlaunch.plugin.tensors import (
    _DTYPES, CaptureError, Group, LayoutMismatch, RestoreError, SnapshotCorrupt, SnapshotTimeout, group_tensors,
    module_tensors,
)

log = logging.getLogger("mxlaunch.plugin")

COPY_SLICE = 64 << 20  # a big tensor is read in slices of this size, from several threads


# ---- restore -------------------------------------------------------------------------------------------


@dataclass
class RestoreResult:
    bytes: int
    tensors: int
    files: int
    seconds: float       # from the call to the last byte in place (waits included)
    wait_seconds: float  # of which spent waiting for files to appear
    copy_bytes: int = 0  # bytes that went through a pageable dest.copy_() (strided, or no pinned path)
    gpu: dict = field(default_factory=dict)  # the CUDA path: registered/ring bytes, pinned bytes, timings


class _Fill:
    """Which storage groups of the target are filled; the checks that make restore exact."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.groups = group_tensors(named)
        self.by_name: dict[str, int] = {n: i for i, g in enumerate(self.groups) for n in g.names}
        self.filled: dict[int, str] = {}  # group index → file that filled it

    def check(self, header: FileHeader, *, landed: bool, pending: dict[int, str] | None = None) -> list[tuple[FileEntry, Group]]:
        """Every entry of the file names a known, not yet filled group with its shape and dtype."""
        plan: list[tuple[FileEntry, Group]] = []
        claimed = dict(self.filled) if pending is None else pending
        unknown = [e.name for e in header.entries if e.name not in self.by_name]
        if unknown:
            raise LayoutMismatch(
                f"{header.path} holds {len(unknown)} tensor(s) the model does not have: {_few(unknown)} "
                "(a snapshot of another model or layout)", landed=landed)
        for e in header.entries:
            index = self.by_name[e.name]
            group = self.groups[index]
            if index in claimed:
                other = claimed[index]
                raise LayoutMismatch(f"tensor {e.name} (storage of {group.name}) is filled twice: by {other} and "
                                     f"by {header.path}", landed=landed)
            t = group.tensor
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise LayoutMismatch(
                    f"tensor {e.name}: the snapshot has {list(e.shape)} {_DTYPES.get(e.dtype, e.dtype)}, the model "
                    f"{list(t.shape)} {_DTYPES.get(t.dtype, t.dtype)} ({header.path})", landed=landed)
            claimed[index] = str(header.path)
            plan.append((e, group))
        for first, others in header.aliases.items():
            for alias in others:
                if self.by_name.get(alias) != self.by_name.get(first):
                    raise LayoutMismatch(f"the snapshot ties {alias} to {first}, the model does not "
                                         f"({header.path})", landed=landed)
        return plan

    def mark(self, header: FileHeader) -> None:
        for e in header.entries:
            self.filled[self.by_name[e.name]] = str(header.path)

    def missing(self) -> list[str]:
        return [g.name for i, g in enumerate(self.groups) if i not in self.filled]


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", … ({len(names) - n} more)" if len(names) > n else "")


def wait_for_file(path: str | os.PathLike[str], timeout_s: float, *, landed: bool = False,
                  cancelled: Callable[[], bool] | None = None) -> float:
    """Poll until `path` exists (the stager renames complete files into place); seconds waited."""
    started = time.perf_counter()
    deadline = started + timeout_s
    delay = 0.002
    while not os.path.exists(path):
        now = time.perf_counter()
        if now >= deadline:
            raise SnapshotTimeout(f"{path} did not appear within {timeout_s:g} s (is the stager running? "
                                  "raise wait_timeout_s in the plan for slow storage)", landed=landed)
        if cancelled is not None and cancelled():
            raise RestoreError(f"cancelled while waiting for {path}", landed=landed)
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.05)
    return time.perf_counter() - started


def default_threads() -> int:
    """MXLAUNCH_RESTORE_THREADS (mxlaunch/settings.py), else one per core up to 8."""
    return settings.restore_threads() or max(1, min(8, os.cpu_count() or 1))


def _cpu_view(t: torch.Tensor) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor, or None when it must go through copy_()."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    try:
        return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError, ValueError):
        return None


def _pread_into(fd: int, view: memoryview, offset: int, path: Path, addr: int = 0, huge: bool = False) -> None:
    """Read len(view) bytes at offset into view; `addr` (the view's address, 0 = unknown) lets the pages be
    made ready first, in this thread (host_pages: the faults, not the copy, are most of a CPU restore)."""
    if addr:
        if huge:
            host_pages.ask_huge(addr, len(view))
        host_pages.populate(addr, len(view))
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise SnapshotCorrupt(f"{path} ended early at byte {offset + done}")
        done += got


def _copy_file(header: FileHeader, plan: list[tuple[FileEntry, Group]], pool: ThreadPoolExecutor | None) -> int:
    """Copy the file's tensors into their groups; returns the bytes that went through copy_() (not preadv)."""
    copied = 0
    fd = os.open(header.path, os.O_RDONLY)
    mm: mmap.mmap | None = None
    try:
        jobs: list[tuple[memoryview, int, int]] = []
        prepare_pages, huge = host_pages.enabled(), host_pages.huge_wanted()
        for entry, group in plan:
            if entry.end == entry.begin:
                continue
            view = _cpu_view(group.tensor)
            if view is not None:
                base = group.tensor.data_ptr() if prepare_pages else 0
                for start in range(0, len(view), COPY_SLICE):
                    jobs.append((view[start:start + COPY_SLICE], entry.begin + start, base and base + start))
                continue
            if mm is None:
                mm = mmap.mmap(fd, header.size, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only mapping: torch warns, we only read from it
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(mm, dtype=torch.uint8, count=entry.end - entry.begin, offset=entry.begin)
            src = src.view(entry.dtype).view(entry.shape)
            group.tensor.copy_(src)  # CUDA or strided destinations: the engine's own device copy
            copied += entry.end - entry.begin
            del src
        if pool is None or len(jobs) < 2:
            for view, offset, addr in jobs:
                _pread_into(fd, view, offset, header.path, addr, huge)
        else:
            for future in [pool.submit(_pread_into, fd, v, o, header.path, a, huge) for v, o, a in jobs]:
                future.result()
        if mm is not None and any(g.tensor.device.type == "cuda" for _, g in plan):
            torch.cuda.synchronize()
        return copied
    finally:
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view still exported: closes when collected
                pass
        os.close(fd)


def _gpu_path(groups: list[Group]) -> object | None:
    """The pinned CUDA path (plugin/gpu_restore.py) when the targets are on a GPU; CPU targets never import it."""
    if not any(g.tensor.device.type == "cuda" for g in groups):
        return None
    from mxlaunch.plugin.gpu_restore import GpuRestore

    return GpuRestore.for_targets([g.tensor for g in groups])


def _split_cuda(plan: list[tuple[FileEntry, Group]], gpu_on: bool,
                scratch: ScratchLanding | None = None) -> tuple[list, list]:
    """Contiguous CUDA destinations go to the pinned path (gpu_restore), and so do non-contiguous ones that
    get a contiguous scratch tensor (plugin/scratch_landing.py: settled after the copies); the rest stay here."""
    if not gpu_on:
        return [], plan
    from mxlaunch.plugin.cuda_copier import cuda_contiguous

    fast: list[tuple[FileEntry, Group]] = []
    keep: list[tuple[FileEntry, Group]] = []
    for e, g in plan:
        if e.end > e.begin and cuda_contiguous(g.tensor):
            fast.append((e, g))
            continue
        landing = None
        if scratch is not None and e.end > e.begin and g.tensor.device.type == "cuda":
            landing = scratch.take(g.tensor)
        if landing is not None:
            fast.append((e, Group(g.names, landing)))
        else:
            keep.append((e, g))
    return fast, keep


def restore_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    files: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], int]],
    *,
    wait_timeout_s: float = 600.0,
    threads: int | None = None,
    on_file: Callable[[FileHeader, float], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> RestoreResult:
    """Fill the `named` tensors from `files`, in order, waiting for each to appear.

    `files` are paths or (path, expected bytes) pairs (0 = size unknown). Before any byte lands, the
    headers of the files already present are checked together (names, shapes, dtypes, duplicates), so a
    snapshot of the wrong model fails with landed=False. Raises RestoreError (see the subclasses).
    """
    started = time.perf_counter()
    fill = _Fill(named)
    specs = [(Path(f[0]), int(f[1])) if isinstance(f, tuple) else (Path(f), 0) for f in files]
    if not specs:
        raise LayoutMismatch("the snapshot lists no files for this rank")
    headers: dict[int, FileHeader] = {}
    # Up-front: every file already in place (at least the first, waited for) is checked before a byte lands.
    waited = wait_for_file(specs[0][0], wait_timeout_s, cancelled=cancelled)
    pending: dict[int, str] = {}
    for i, (path, size) in enumerate(specs):
        if i and not path.exists():
            continue
        headers[i] = read_header(path, size)
        fill.check(headers[i], landed=False, pending=pending)
    if len(headers) == len(specs):
        missing = [g.name for j, g in enumerate(fill.groups) if j not in pending]
        if missing:
            raise LayoutMismatch(f"the snapshot lacks {len(missing)} tensor(s) of the model: {_few(missing)}")
    landed = False
    nbytes = 0
    copy_bytes = 0
    n_threads = threads or default_threads()
    pool = ThreadPoolExecutor(n_threads, thread_name_prefix="mxlaunch-restore") if n_threads > 1 else None
    gpu = _gpu_path(fill.groups)
    scratch = ScratchLanding() if gpu is not None else None
    try:
        for i, (path, size) in enumerate(specs):
            if i not in headers:
                waited += wait_for_file(path, max(0.0, wait_timeout_s), landed=landed, cancelled=cancelled)
                headers[i] = read_header(path, size)
            header = headers[i]
            try:
                plan = fill.check(header, landed=landed)
            except RestoreError as exc:
                exc.landed = landed
                raise
            landed = landed or bool(plan)
            fast, plan = _split_cuda(plan, gpu is not None, scratch)
            try:
                if fast:
                    gpu.submit(header, fast)
                copy_bytes += _copy_file(header, plan, pool)
            except RestoreError as exc:
                exc.landed = True
                raise
            except (OSError, RuntimeError, ValueError) as exc:
                raise RestoreError(f"copying {path} into the model failed: {exc}", landed=True) from exc
            fill.mark(header)
            nbytes += header.bytes
            if on_file is not None:
                on_file(header, time.perf_counter() - started)
        if gpu is not None:
            try:
                gpu.finish()  # every copy has completed: the scratch tensors hold their bytes
                if scratch is not None and scratch.pairs:
                    gpu.report["scratch_bytes"] = scratch.settle()
            except (OSError, RuntimeError, ValueError) as exc:
                raise RestoreError(f"copying the snapshot to the GPU failed: {exc}", landed=True) from exc
    except SnapshotCorrupt as exc:
        exc.landed = landed or exc.landed
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        if gpu is not None:
            gpu.abort()
        if scratch is not None:
            scratch.drop()
    missing = fill.missing()
    if missing:
        raise LayoutMismatch(f"the snapshot lacks {len(missing)} tensor(s) of the model: {_few(missing)}",
                             landed=landed)
    return RestoreResult(bytes=nbytes, tensors=len(fill.groups), files=len(specs),
                         seconds=time.perf_counter() - started, wait_seconds=waited, copy_bytes=copy_bytes,
                         gpu=gpu.report if gpu is not None else {})


__all__ = [
    "ALIASES_KEY", "MAX_HEADER", "PART_BYTES", "PART_NAME", "SCHEMA_KEY",
    "CaptureError", "CaptureResult", "FileEntry", "FileHeader", "Group", "LayoutMismatch", "RestoreError",
    "RestoreResult", "SnapshotCorrupt", "SnapshotTimeout", "capture_tensors", "group_tensors", "module_tensors",
    "read_header", "restore_tensors", "wait_for_file",
]
