"""Cleaning /dev/shm: this run's folder, folders of launchers that died, segments a dead engine left.

/dev/shm is RAM: anything left there stays until reboot. The run folder goes on every exit path
(Launcher._cleanup); stale run folders (their owner pid is gone) go at the next launch; shared-memory
segments that appeared during the run, are ours and nobody maps any more go at the end of the run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from mxlaunch.engines.registry import ENGINES
from mxlaunch.fileutil import pid_alive

SHM_ROOT = Path("/dev/shm")


def shm_user_root() -> Path:
    return SHM_ROOT / f"mxlaunch-{os.getuid()}"


def remove_stale_runs(root: Path) -> list[Path]:
    """Run folders whose owning launcher is gone (crashed, SIGKILLed) are removed."""
    removed = []
    if not root.is_dir():
        return removed
    for run in root.iterdir():
        try:
            owner = json.loads((run / "owner.json").read_text())
            alive = pid_alive(int(owner["pid"]), int(owner.get("start_time", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            alive = time.time() - run.stat().st_mtime < 60  # no owner file yet: only a very new folder is spared
        if not alive:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


# Python multiprocessing's shared memory and its named semaphores (engines' message queues use them), and
# what each engine leaves on its own (engines/protocol.py `shm_prefixes`).
PYTHON_SHM_PREFIXES = ("psm_", "sem.mp-")
ENGINE_SHM_PREFIXES = PYTHON_SHM_PREFIXES + tuple(p for e in ENGINES.values() for p in e.shm_prefixes)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_ROOT))
    except OSError:
        return set()


def _mapped_paths() -> set[str]:
    """Files any live process has mapped (from /proc/*/maps; unreadable processes are skipped): their
    paths and "inode:<n>" entries — glibc's sem_open maps a temp file and then links it to sem.<name>,
    so a live named semaphore shows under the temp name and only its inode identifies it."""
    mapped: set[str] = set()
    root = f"{SHM_ROOT}/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    if root in line:
                        fields = line.split(None, 5)
                        mapped.add(fields[-1].strip().removesuffix(" (deleted)"))
                        mapped.add(f"inode:{fields[4]}")
        except (OSError, IndexError):
            continue
    return mapped


def remove_orphaned_engine_shm(before: set[str]) -> list[str]:
    """Shared-memory segments that appeared during this run, are ours, and nobody maps any more.

    A crashed or SIGKILLed engine cannot unlink its segments (vLLM's are ~200 MB each); they would
    stay in /dev/shm — which is RAM — until reboot."""
    new = [n for n in shm_entries() - before if n.startswith(ENGINE_SHM_PREFIXES)]
    if not new:
        return []
    mapped = _mapped_paths()
    removed = []
    for name in sorted(new):
        path = SHM_ROOT / name
        try:
            st = path.stat()
            if st.st_uid != os.getuid() or str(path) in mapped or f"inode:{st.st_ino}" in mapped:
                continue
            path.unlink()
            removed.append(name)
        except OSError:
            continue
    return removed


def remove_run(run_dir: Path) -> None:
    """Remove this run's folder (and the per-user folder once empty)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        shm_user_root().rmdir()
    except OSError:
        pass
