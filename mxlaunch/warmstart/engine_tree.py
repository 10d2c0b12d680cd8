"""An engine snapshot's view of the engine's process tree: what its processes hold (from /proc), and the
engine's actions asked through mxlaunch's signal handler (sleep, wake, refill, release NVML).

Why a module of its own: taking a snapshot (warmstart/snapshot_take.py) and waking or refilling a restored one
(warmstart/snapshot_restore.py) both speak the signal protocol (mxlaunch/contract.py; the engine's side is
plugin/snapshot_signal.py), and what the tree holds decides what a dump may take (no GPU device file, only
this user's own /dev/shm files).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from mxlaunch.contract import SNAPSHOT_RELEASED as SUFFIX
from mxlaunch.contract import SNAPSHOT_SIGNAL_NUMBER, snapshot_action_path as action_path
from mxlaunch.contract import snapshot_done_path as done_path
from mxlaunch.warmstart import snapshot_files
from mxlaunch.warmstart.engine_snapshot import SHM, NotAsked, SnapshotError

SIGNAL = signal.Signals(SNAPSHOT_SIGNAL_NUMBER)  # SIGUSR2 (the protocol: mxlaunch/contract.py)
ACTION_TIMEOUT_S = 300.0  # a sleep copies the weights to host memory, a wake back: seconds for hundreds of GiB


def catches(pid: int, sig: int) -> bool:
    """Whether the process handles `sig` (SigCgt): SIGUSR2 goes only to those, it would kill the others."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def open_files(pid: int) -> list[str]:
    found = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        pass
    return found


def mapped_files(pid: int) -> list[str]:
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return [parts[5] for parts in (line.split(None, 5) for line in lines) if len(parts) == 6]


def device_files(pids: Sequence[int]) -> dict[int, list[str]]:
    held = {p: sorted({f for f in open_files(p) if f.startswith("/dev/nvidia")}) for p in pids}
    return {p: files for p, files in held.items() if files}


def shm_files(pids: Sequence[int]) -> list[str]:
    """The /dev/shm files the tree holds open or mapped that still have a name (unlinked ones CRIU keeps), each
    a regular file of this user's. SnapshotError for a held name that is another user's (or no longer the
    held file): its copy would be served back to the restored engine."""
    names = {f for p in pids for f in (*open_files(p), *mapped_files(p))}
    named = sorted(n for n in names if n.startswith(f"{SHM}/") and not n.endswith("(deleted)"))
    held = snapshot_files.held_inodes(pids, str(SHM))
    out = []
    for name in named:
        try:
            st = os.lstat(name)
        except OSError:
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            continue  # a folder, a socket: nothing to keep
        why = snapshot_files.own_held(name, held, os.getuid())
        if why:
            raise SnapshotError(f"the engine holds {name}, which {why}: not snapshotting it")
        out.append(name)
    return out


def process_title(pid: int, limit: int = 80) -> str:
    """The process's command line as `ps` shows it (SGLang retitles its children `sglang::scheduler_TP0`,
    `sglang::detokenizer`): which of an engine's processes a refusal is about. "" when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    title = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return title if len(title) <= limit else title[:limit - 1] + "…"


def output_pipes(pid: int) -> list[str]:
    return sorted({t for fd in (1, 2) if (t := _readlink(f"/proc/{pid}/fd/{fd}")) and t.startswith("pipe:")})


def _readlink(path: str) -> Optional[str]:
    try:
        return os.readlink(path)
    except OSError:
        return None


def release_nvml(pids: Sequence[int], marks: Path, timeout: float = 10.0) -> list[int]:
    """Ask every process with mxlaunch's handler to shut NVML down; the pids that answered."""
    asked = [p for p in pids if catches(p, SIGNAL)]
    for p in asked:
        (marks / f"{p}{SUFFIX}").unlink(missing_ok=True)
        os.kill(p, SIGNAL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answered = [p for p in asked if (marks / f"{p}{SUFFIX}").exists()]
        if len(answered) == len(asked):
            return answered
        time.sleep(0.02)
    missing = sorted(set(asked) - {p for p in asked if (marks / f"{p}{SUFFIX}").exists()})
    raise SnapshotError(f"engine process(es) {missing} did not release NVML in {timeout:.0f} s")


def engine_action(pid: int, marks: Path, action: str, timeout: float = ACTION_TIMEOUT_S, arg: str = "") -> float:
    """Have the engine's API server (`pid`) "sleep", "wake", "sleep-lean" or "refill <plan>"
    (plugin/snapshot_signal.py); the seconds it took. Raises SnapshotError when it cannot: no handler, the
    engine's own error, no answer within `timeout`."""
    return engine_order(pid, marks, action, timeout, arg)[0]


def engine_order(pid: int, marks: Path, action: str, timeout: float = ACTION_TIMEOUT_S,
                 arg: str = "") -> tuple[float, Any]:
    """engine_action, with what the action returned (a refill: each worker's report)."""
    if not catches(pid, SIGNAL):
        raise NotAsked(f"engine process {pid} has no mxlaunch handler to {action} it")
    done = Path(done_path(str(marks), pid, action))
    done.unlink(missing_ok=True)
    order = Path(action_path(str(marks), pid))
    tmp = order.with_name(order.name + ".tmp")
    tmp.write_text(f"{action} {arg}".strip(), encoding="utf-8")
    os.replace(tmp, order)
    t0 = time.monotonic()
    os.kill(pid, SIGNAL)
    while not done.exists():
        if time.monotonic() - t0 > timeout:
            order.unlink(missing_ok=True)
            raise SnapshotError(f"the engine did not {action} within {timeout:.0f} s")
        time.sleep(0.02)
    report = json.loads(done.read_text(encoding="utf-8"))
    done.unlink(missing_ok=True)
    if report.get("error"):
        # nothing changed in the engine: no client to ask (LookupError), or files that cannot refill it (NotLean)
        error = NotAsked if str(report["error"]).startswith(("LookupError:", "NotLean:")) else SnapshotError
        raise error(f"the engine could not {action}: {report['error']}")
    return time.monotonic() - t0, report.get("result")
