"""Capture: write a model's raw tensors as the snapshot's safetensors parts.

Each part is written under a temp name (`.part-….tmp`), fsynced, then renamed — a reader never sees
half a file; on any error the parts written so far are removed. CPU tensors stream straight from their
memory; CUDA tensors go device→host through pinned slots (plugin/cuda_capture.py), several parts at once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

import torch

from mxlaunch import settings
from mxlaunch.plugin.snapshot_files import ALIASES_KEY, PART_BYTES, PART_NAME, SCHEMA_KEY, _header, write_cpu_tensor
from mxlaunch.plugin.tensors import CaptureError, Group, group_tensors

log = logging.getLogger("mxlaunch.plugin")


@dataclass
class CaptureResult:
    files: list[Path]
    bytes: int          # tensor bytes written (each storage group once)
    tensors: int        # groups written
    seconds: float
    prepared: dict | None = None  # set when the parts were prepared during loading (capture_prepare)


def _plan_parts(groups: list[Group], part_bytes: int) -> list[list[Group]]:
    parts: list[list[Group]] = [[]]
    size = 0
    for g in groups:
        n = g.tensor.numel() * g.tensor.element_size()
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(g)
        size += n
    return [p for p in parts if p] or [[]]


def capture_meta(groups: list[Group], metadata: dict[str, str] | None) -> tuple[dict[str, str], bool]:
    """The files' metadata (aliases included), and whether any group has aliases."""
    aliases = {g.name: g.names[1:] for g in groups if len(g.names) > 1}
    meta = {"format": "pt", SCHEMA_KEY: "1", **(metadata or {})}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True, separators=(",", ":"))
    return meta, bool(aliases)


def part_jobs(groups: list[Group], out: Path, meta: dict[str, str], aliases: bool,
              part_bytes: int) -> list[tuple[Path, list[Group], dict[str, str]]]:
    """[(final path, its groups, its metadata)] — the same for the writers and for a prepared capture."""
    return [(out / PART_NAME.format(i), part, _part_meta(part, meta, aliases))
            for i, part in enumerate(_plan_parts(groups, part_bytes))]


def _part_meta(part: list[Group], meta: dict[str, str], aliases: bool) -> dict[str, str]:
    """Each part records the aliases of its own tensors only."""
    part_meta = dict(meta)
    if aliases:
        own = {g.name: g.names[1:] for g in part if len(g.names) > 1}
        part_meta.pop(ALIASES_KEY)
        if own:
            part_meta[ALIASES_KEY] = json.dumps(own, sort_keys=True, separators=(",", ":"))
    return part_meta


def _huge_pages(fh: BinaryIO, size: int, pager: Any) -> None:
    """tmpfs: lay the part out in 2 MiB pages before writing (writes then allocate nothing per 4 KiB)."""
    from mxlaunch.memory.hugepages import FileMapping

    os.ftruncate(fh.fileno(), size)
    mapping = FileMapping(fh.fileno(), size)
    try:
        pager.prepare(mapping, fh.fileno(), 0, size)
    finally:
        mapping.close()


def temp_path(final: Path) -> Path:
    """Where a part is written before its rename into place (hidden, per process)."""
    return final.with_name(f".{final.name}.{os.getpid()}.tmp")


def _write_part(final: Path, part: list[Group], meta: dict[str, str], fsync: bool,
                write: Callable[[BinaryIO, torch.Tensor], int], pager: Any = None) -> int:
    """One part under a temp name, fsynced, renamed into place; the temp file never outlives a failure."""
    tmp = temp_path(final)
    try:
        with open(tmp, "w+b") as fh:
            header = _header(part, meta)
            if pager is not None and pager.enabled:
                _huge_pages(fh, len(header) + sum(g.tensor.numel() * g.tensor.element_size() for g in part), pager)
            fh.write(header)
            total = sum(write(fh, g.tensor) for g in part)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return total


def _tmpfs_pager(out: Path) -> Any:
    """2 MiB pages for parts written into tmpfs: opt-in (MXLAUNCH_CAPTURE_HUGE=1) — on the 1×H200
    machine they made the capture slower (8.8 against 9.9 GiB/s at 8 writers), the collapse costs more
    than the 4 KiB pages it saves when 8–16 writers allocate at once."""
    from mxlaunch.plugin.cuda_copier import is_tmpfs

    if not settings.capture_huge() or not is_tmpfs(out):
        return None
    from mxlaunch.memory.hugepages import HugePager

    return HugePager(max_cpu_s_per_gib=0.3)


def _pinned_capture(groups: list[Group], parts: int) -> Any:
    """The device→host path when the tensors live on one GPU (None: pageable copies, one thread)."""
    devices = {g.tensor.device for g in groups if g.tensor.device.type == "cuda"}
    if len(devices) != 1 or settings.gpu_copy() == "pageable":
        return None
    from mxlaunch.plugin.cuda_capture import PinnedCapture, capture_writers
    from mxlaunch.plugin.pinned import PinError

    try:
        return PinnedCapture(devices.pop(), capture_writers(parts))
    except (PinError, RuntimeError, OSError) as exc:
        log.warning("mxlaunch: no pinned memory for the capture, copying through pageable memory: %s", exc)
        return None


def capture_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike[str],
    *,
    part_bytes: int = PART_BYTES,
    fsync: bool = True,
    metadata: dict[str, str] | None = None,
    prepared: Any = None,
) -> CaptureResult:
    """Write `named` tensors (each storage group once) as safetensors parts into `out_dir`.

    Each part appears by rename when complete. On any error the parts written so far and the temp files
    are removed and CaptureError is raised. `prepared` (plugin/capture_prepare.PreparedCapture, started
    while the engine loaded) is used when it still fits the tensors: then the capture is the copies alone.
    """
    started = time.perf_counter()
    out = Path(out_dir)
    groups = group_tensors(named)
    if prepared is not None and prepared.take(groups) is not None:
        files, total = prepared.write(groups, fsync=fsync)
        if fsync:
            _fsync_dir(out)
        return CaptureResult(files=files, bytes=total, tensors=len(groups), seconds=time.perf_counter() - started,
                             prepared={"prepare_seconds": round(prepared.seconds, 4),
                                       "wait_seconds": round(prepared.wait_seconds, 4),
                                       "huge_bytes": prepared.huge_bytes})
    meta, aliases = capture_meta(groups, metadata)
    jobs = part_jobs(groups, out, meta, aliases, part_bytes)
    written: list[Path] = []
    total = 0
    gpu = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        gpu = _pinned_capture(groups, len(jobs))
        if gpu is None:
            for final, part, part_meta in jobs:
                total += _write_part(final, part, part_meta, fsync, write_cpu_tensor)
                written.append(final)
        else:
            torch.cuda.synchronize(gpu.device)  # the engine's own streams have finished with the weights

            pager = _tmpfs_pager(out)

            def job(final: Path, part: list[Group], part_meta: dict[str, str]) -> int:
                with gpu.writer() as w:
                    n = _write_part(final, part, part_meta, fsync, w.write, pager)
                written.append(final)
                return n

            with ThreadPoolExecutor(gpu.writers, thread_name_prefix="mxlaunch-capture") as pool:
                futures = [pool.submit(job, *j) for j in jobs]
                try:
                    total = sum(f.result() for f in futures)
                finally:
                    for f in futures:
                        f.cancel()
        if fsync:
            _fsync_dir(out)
    except BaseException as exc:
        for path in written:
            path.unlink(missing_ok=True)
        if isinstance(exc, (CaptureError, KeyboardInterrupt, SystemExit)):
            raise
        raise CaptureError(f"cannot write the snapshot into {out}: {exc}") from exc
    finally:
        if gpu is not None:
            gpu.close()
    return CaptureResult(files=sorted(written), bytes=total, tensors=len(groups),
                         seconds=time.perf_counter() - started)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
