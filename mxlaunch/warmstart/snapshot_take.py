"""Taking an engine snapshot: the serving tree paused (asleep where it can), its GPU state checkpointed, dumped
by CRIU with --leave-running, and the engine serving on; with what a restore needs beside CRIU's images.

Why a module of its own: the pause is the one moment the serving engine stops answering, and each of its steps
(sleep, NVML released, CUDA lock and checkpoint, the dump, restore and unlock, wake or refill) must be undone
whatever fails; the folder's layout is warmstart/engine_snapshot.py's, the thread that calls this once the
capture is published warmstart/snapshot_maker.py's.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from mxlaunch.safety.ownership import create_own
from mxlaunch.warmstart import criu, held_files, snapshot_files, working_set
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpoint
from mxlaunch.warmstart.engine_snapshot import DUMP_FLAGS, META, SHM, NotAsked, SnapshotError
from mxlaunch.warmstart.engine_tree import (device_files, engine_action, mapped_files, open_files, output_pipes,
                                            process_title, release_nvml, shm_files)
from mxlaunch.warmstart.snapshot_files import process_tree
from mxlaunch.warmstart.snapshot_key import RECORD


def take(binary: str, root_pid: int, folder: Path, marks: Path, cuda: Optional[CudaCheckpoint],
         sleep: bool = False, facts: Optional[Mapping[str, Any]] = None,
         lean: Optional[Callable[[], str]] = None) -> dict:
    """Snapshot the serving tree at `root_pid` into `folder` (made here); the engine serves on. `sleep`: the
    engine (vLLM with --enable-sleep-mode) sleeps while it is snapshotted, and the restore wakes it. `lean`
    (with `sleep`): it sleeps at level 2 — its weights left out of the image — and the serving engine then
    refills them from the plan file `lean()` writes (warmstart/lean_snapshot.py); a restore refills them likewise.
    `facts`: what its key digests (snapshot_key.key_facts), written as key.json. Returns the meta written to
    meta.json plus the pause's phases."""
    pids = process_tree(root_pid)
    t_set = time.monotonic()  # before the pause: the pages the serving tree touched, read ahead at a restore
    touched = working_set.record(pids, skip=(str(folder.parent), str(marks)))
    working_set_s = time.monotonic() - t_set
    t_pause = time.monotonic()
    sleep_s, sleep_skipped = 0.0, None
    refill_from = lean() if sleep and lean is not None else ""  # before anything changed: a failure takes nothing
    lean = lean if refill_from else None
    wake = (lambda: engine_action(root_pid, marks, "refill", arg=refill_from)) if lean else \
        (lambda: engine_action(root_pid, marks, "wake"))
    if sleep:
        try:
            sleep_s = engine_action(root_pid, marks, "sleep-lean", arg=refill_from) if lean else \
                engine_action(root_pid, marks, "sleep")
        except NotAsked as exc:  # nothing changed: the snapshot is taken awake (its KV cache in the image) ...
            if lean:  # ... but never a full image where a lean one was asked for (it would go into the store)
                raise SnapshotError(f"no lean snapshot taken: {exc}") from None
            sleep, lean, sleep_skipped = False, None, str(exc)
        except SnapshotError:
            try:  # a sleep that failed half-way must not leave the engine asleep (nor without its weights)
                wake()
            except (SnapshotError, OSError):
                _stop_weightless(root_pid, lean)
            raise
    wake_s = 0.0
    try:
        release_nvml(pids, marks)
        gpu = cuda.with_cuda(pids) if cuda is not None else []
        folder.mkdir(parents=True, mode=0o700)
        script = _post_dump_script(folder, root_pid)
        checkpoint_s = cuda.run(("lock", "checkpoint"), gpu) if cuda is not None and gpu else 0.0
        try:
            held = device_files(pids)
            if held:
                pid, files = next(iter(held.items()))
                # which process, and whether the driver checkpointed it: a process the driver knows no CUDA state
                # of holds NVML's files (no mxlaunch handler released them) or a cuInit the driver cannot checkpoint
                what = process_title(pid) + ("" if pid in gpu else "; the driver reports no CUDA state for it")
                raise SnapshotError(f"engine process {pid} ({what}) still holds {', '.join(files)} after the CUDA "
                                    "checkpoint: CRIU cannot dump it")
            meta = {"root": root_pid, "pids": pids, "gpu_pids": gpu, "pipes": output_pipes(root_pid),
                    "shm_files": shm_files(pids), "kernel": os.uname().release, "slept": sleep, "marks": str(marks),
                    "lean": bool(lean), "working_set": touched,
                    "held": held_files.record(held_files.held_paths(pids, open_files, mapped_files), folder)}
            t_dump = time.monotonic()
            criu.dump(binary, root_pid, folder, timeout=600.0,
                      extra=("--leave-running", "--action-script", str(script), *DUMP_FLAGS))
            dump_s = time.monotonic() - t_dump
        finally:
            restore_s = cuda.run(("restore", "unlock"), gpu) if cuda is not None and gpu else 0.0
    finally:
        if sleep:  # the serving engine wakes whatever happened: asleep, it would answer no request
            try:
                wake_s = wake()
            except (SnapshotError, OSError):
                _stop_weightless(root_pid, lean)
                raise
    pause_s = time.monotonic() - t_pause
    script.unlink(missing_ok=True)
    _keep_files(folder, meta)
    if facts is not None:
        _write_new(folder / RECORD, json.dumps(facts, indent=1, sort_keys=True))
    meta.update(made=time.time(), bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))
    _write_new(folder / META, json.dumps(meta))
    phases = {"sleep_s": sleep_s, "checkpoint_s": checkpoint_s, "dump_s": dump_s, "gpu_restore_s": restore_s,
              "wake_s": wake_s, "pause_s": pause_s, "working_set_s": working_set_s}
    result = {k: v for k, v in meta.items() if k != "working_set"}  # the pages' list stays in meta.json
    return {**result, "working_set_files": len(touched), "sleep_skipped": sleep_skipped,
            **{k: round(v, 3) for k, v in phases.items()}}


def _stop_weightless(root_pid: int, lean: Optional[Callable[[], str]]) -> None:
    """A lean sleep whose refill failed leaves an engine without its weights: it must not serve, so it is
    stopped (the launcher then exits with the engine's code). An engine asleep at level 1 keeps its weights."""
    if lean is not None:
        try:
            os.kill(root_pid, signal.SIGTERM)
        except OSError:
            pass


def _write_new(path: Path, text: str) -> None:
    fd = create_own(path)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def _post_dump_script(folder: Path, root_pid: int) -> Path:
    """CRIU's action script: at post-dump (the engine frozen), copy the link-remap files CRIU made for the
    tree (a hard link to an unlinked file it holds, e.g. a POSIX semaphore) before --leave-running makes CRIU
    delete them; a restore needs them and consumes them. The copying is warmstart/snapshot_files.py's, run by
    this interpreter isolated (-I -S: the standard library only): only regular files of this uid that the
    tree holds, never blocking on a FIFO, never following a link."""
    script = folder / "post-dump.sh"
    command = shlex.join([sys.executable, "-I", "-S", str(Path(snapshot_files.__file__).resolve()), str(SHM),
                          str(folder / "link-remaps"), str(root_pid), str(os.getuid())])
    _write_new(script, f"#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\nexec {command}\n")
    script.chmod(0o700)
    return script


def _keep_files(folder: Path, meta: dict) -> None:
    """Keep what a restore needs that is not in CRIU's images: the link-remap files (the post-dump step copied
    them) and copies of the named /dev/shm files as they were at the dump — each read without following a
    link and only while it is still the file the engine holds (snapshot_files.copy_held)."""
    remaps = folder / "link-remaps"
    remaps.mkdir(mode=0o700, exist_ok=True)
    meta["link_remaps"] = sorted(os.listdir(remaps))
    kept = folder / "shm-files"
    kept.mkdir(mode=0o700)
    held = snapshot_files.held_inodes(process_tree(meta["root"]), str(SHM))
    for path in meta["shm_files"]:
        try:
            snapshot_files.copy_held(path, str(kept / Path(path).name), held, os.getuid())
        except ValueError as exc:
            raise SnapshotError(f"cannot keep {path} for the restore: it {exc}") from None
        except OSError as exc:
            raise SnapshotError(f"cannot keep {path} for the restore: {exc.strerror or exc}") from None
