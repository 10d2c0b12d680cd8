"""Engine snapshots: an initialized engine checkpointed once (GPU state by the CUDA driver, processes by CRIU),
restored on the node's next start with the same command instead of starting the engine at all.

Why: with the weights at 0.16 s, a vLLM start is the engine's own start-up (two interpreters, model build,
profile, KV cache, HTTP). A restored engine skips all of it: on the H200 (vLLM 0.26, the 8 GiB Llama, 17 GiB
of GPU memory) the probe restored one in 11.7–12.4 s against 38–77 s (docs/benchmarks.md), every answer exact.

Layout (node-local: an image holds the engine's whole memory, its GPU memory included, tens of GiB):

    $MXLAUNCH_ENGINE_SNAPSHOTS (default ~/.cache/mxlaunch/engine-snapshots)/<uid>/   0700, this user's alone
        key-salt                    the salt of the key's digests (warmstart/snapshot_key.py), 0600
        <key>/                      one per command and environment (snapshot_key.py: argv, named files, source id,
                                    interpreter, kernel, cwd, every variable but the run-only ones)
            key.json                what the key digests: values of variables and secrets only as salted digests
            meta.json               pids, the GPU pids, the output pipe's inode, the files put back before a restore
            *.img                   CRIU's files
            link-remaps/            unlinked files CRIU kept by a link (POSIX semaphores): a restore consumes them
            shm-files/              /dev/shm files the engine had open (the launcher's cleanup removes them)

/dev/shm is every user's (docs/security.md): the post-dump step takes only link-remap files that are regular,
this user's and held by the dumped tree (warmstart/snapshot_files.py), the named files are read without following
a link, and a restore puts each file back only as a new name (O_EXCL | O_NOFOLLOW): a name another user took
first refuses the restore (one event; the engine starts as usual), nothing is written through it.
        .<key>.<pid>.tmp/           a snapshot in progress, renamed into place when complete

Taking one (`take`, once the first start is ready and its capture is published; the engine pauses for it):
vLLM started with --enable-sleep-mode is first put to sleep at level 1 (its weights to host memory, the KV
cache discarded: an idle engine's KV cache is garbage, and it was most of the image); then SIGUSR2 to every
engine process that installed mxlaunch's handler (plugin/snapshot_signal.py: NVML shut down), lock +
checkpoint every process with CUDA state, `criu dump --leave-running`, restore + unlock, wake up: the engine
serves on. Restoring (`restore`): the files put back, `criu restore -d` with a new output pipe (--inherit-fd),
the GPU state restored and unlocked, the engine woken (a snapshot taken asleep); the launcher (a child
subreaper) becomes the restored tree's parent.

What it needs, checked before anything is tried: CRIU 4.2+ (4.1 fails on 6.16+ kernels' sockets), the
capability, the driver's checkpoint API where there is a GPU, and an engine started by the launcher with
io_uring filtered out (warmstart/no_io_uring.py). TCP connections are closed at restore (--tcp-close): clients
reconnect. Any failure is a `SnapshotError` or `CriuError`; the launcher then starts the engine as usual.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from mxlaunch import settings
from mxlaunch.fileutil import pid_alive
from mxlaunch.warmstart import criu, held_files, snapshot_files
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpoint, CudaCheckpointError
from mxlaunch.warmstart.snapshot_files import process_tree
from mxlaunch.warmstart.snapshot_key import RECORD, snapshot_key  # noqa: F401 (snapshot_key: the tests take it here)
from mxlaunch.warmstart.zygote import private_dir
from mxlaunch.contract import SNAPSHOT_RELEASED as SUFFIX
from mxlaunch.contract import SNAPSHOT_SIGNAL_NUMBER, snapshot_action_path as action_path
from mxlaunch.contract import snapshot_done_path as done_path
from mxlaunch.safety.ownership import ForeignPath, create_own, foreign, open_own, own_dir

SIGNAL = signal.Signals(SNAPSHOT_SIGNAL_NUMBER)  # SIGUSR2 (the protocol: mxlaunch/contract.py)

META = "meta.json"
SHM = Path("/dev/shm")
PR_SET_CHILD_SUBREAPER = 36
DUMP_FLAGS = ("--tcp-close", "--ext-unix-sk", "--file-locks", "--link-remap", "--ghost-limit", str(1 << 30))
ACTION_TIMEOUT_S = 300.0  # a sleep copies the weights to host memory, a wake back: seconds for hundreds of GiB


class SnapshotError(Exception):
    """Why no snapshot was taken or restored (one line)."""


class NotAsked(SnapshotError):
    """An engine action that could not even be asked for (no handler, no engine client): nothing changed."""


def snapshots_root(environ: Mapping[str, str] = os.environ) -> Path:
    base = settings.engine_snapshots(environ) or Path.home() / ".cache" / "mxlaunch" / "engine-snapshots"
    return base / str(os.getuid())


def own_root(environ: Mapping[str, str] = os.environ) -> Path:
    """snapshots_root(), made if missing and checked: a real folder of this uid's that nobody else can enter
    (ownership.own_dir, 0700), below folders nobody else can rename it in (safe_ancestors). ForeignPath (one
    line naming the path and the fix) otherwise: an image is code, restored as this user."""
    root = snapshots_root(environ)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ForeignPath(f"cannot make {root.parent}: {exc.strerror or exc}",
                          f"point {settings.ENGINE_SNAPSHOTS} at a folder of yours") from None
    safe_ancestors(root.parent)
    own_dir(root)
    if not private_dir(root):  # own_dir allows group read; an image holds the engine's memory, secrets included
        raise ForeignPath(f"{root} is open to others (mode {os.lstat(root).st_mode & 0o777:04o})",
                          f"chmod 700 {root}")
    return root


def safe_ancestors(path: Path) -> None:
    """ForeignPath unless every folder from `path` up to / belongs to this uid or root and is writable by nobody
    else, or sticky (as /tmp): otherwise another user could rename the snapshots folder away and put theirs
    in its place between the check and CRIU reading it."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        st = os.stat(folder)
        mode = st.st_mode & 0o7777
        if st.st_uid not in (0, os.getuid()):
            why = f"belongs to uid {st.st_uid}"
        elif mode & 0o022 and not mode & 0o1000:
            why = f"is writable by others without the sticky bit (mode {mode:04o})"
        else:
            continue
        raise ForeignPath(f"{folder} (above the engine snapshots) {why}: another user could swap the snapshots",
                          f"point {settings.ENGINE_SNAPSHOTS} at a folder only you can write")


def find(root: Path, key: str) -> Optional[Path]:
    """The published snapshot for `key` in a folder only this user controls, or None."""
    folder = root / key
    if not private_dir(root) or not (folder / META).is_file() or os.lstat(folder).st_uid != os.getuid():
        return None
    return folder


# ---- the engine's processes -------------------------------------------------------------------------------


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


# ---- taking a snapshot -----------------------------------------------------------------------------------


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
                raise SnapshotError(f"engine process {pid} still holds {', '.join(files)} after the CUDA checkpoint: "
                                    "CRIU cannot dump it")
            meta = {"root": root_pid, "pids": pids, "gpu_pids": gpu, "pipes": output_pipes(root_pid),
                    "shm_files": shm_files(pids), "kernel": os.uname().release, "slept": sleep, "marks": str(marks),
                    "lean": bool(lean),
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
              "wake_s": wake_s, "pause_s": pause_s}
    return {**meta, "sleep_skipped": sleep_skipped, **{k: round(v, 3) for k, v in phases.items()}}


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


class SnapshotMaker(threading.Thread):
    """Takes the snapshot beside the serving engine once `ready_to_take()` says so (the capture published),
    publishes it by rename, and reports one `engine-snapshot` event (published, or failed with the reason)."""

    def __init__(self, binary: str, root_pid: int, key: str, marks: Path, emit: Callable[..., None],
                 ready_to_take: Callable[[], Optional[bool]], environ: Mapping[str, str] = os.environ,
                 sleep: bool = False, facts: Optional[Mapping[str, Any]] = None,
                 lean: Optional[Callable[[], str]] = None, sums: bool = False) -> None:
        super().__init__(name="mx-engine-snapshot", daemon=True)
        self.binary, self.root_pid, self.key, self.marks, self.sleep = binary, root_pid, key, marks, sleep
        self.lean, self.sums = lean, sums  # sums: the image goes into the store, checked at every restore
        self.emit, self.ready_to_take, self.facts, self.environ = emit, ready_to_take, facts, environ
        self.root = snapshots_root(environ)
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while True:  # True: take it now; False: never (the capture failed); None: not yet
                decided = self.ready_to_take()
                if decided is not None or self.stopping.is_set():
                    break
                time.sleep(0.2)
            if not decided or self.stopping.is_set():
                return
            result = self._make()
            self.emit("engine-snapshot", status="published", key=self.key, **result)
        except (SnapshotError, CriuError, CudaCheckpointError, OSError) as exc:
            self.emit("engine-snapshot", status="failed", key=self.key, reason=str(exc))
        except ForeignPath as exc:
            self.emit("engine-snapshot", status="failed", key=self.key, reason=exc.one_line())

    def _make(self) -> dict:
        self.root = own_root(self.environ)  # checked again: this user's alone, nobody else can swap it
        if find(self.root, self.key) is not None:
            raise SnapshotError("a snapshot of this command exists already")
        tmp = self.root / f".{self.key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            result = take(self.binary, self.root_pid, tmp, self.marks, cuda_or_none(), sleep=self.sleep,
                          facts=self.facts, lean=self.lean)
            if self.sums:
                from mxlaunch.warmstart.image_sums import write_sums  # noqa: PLC0415

                t0 = time.monotonic()
                write_sums(tmp)
                result["sums_s"] = round(time.monotonic() - t0, 3)
            final = self.root / self.key
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {k: result[k] for k in ("slept", "lean", "sleep_skipped", "sleep_s", "checkpoint_s", "dump_s", "gpu_restore_s",
                                       "wake_s", "pause_s", "bytes")} | {"path": str(final), "gpu_pids": len(result["gpu_pids"]),
                                                                         "sums_s": result.get("sums_s")}


def cuda_or_none() -> Optional[CudaCheckpoint]:
    """The driver's API where there is a driver; None on a CPU engine's node."""
    try:
        return CudaCheckpoint()
    except OSError:
        return None


# ---- restoring -------------------------------------------------------------------------------------------


class RestoredEngine:
    """A restored engine tree, driven like the Popen of a spawned one (the launcher is its subreaper)."""

    def __init__(self, pid: int, stdout_fd: int, tree: Sequence[int] = (), meta: Optional[Mapping[str, Any]] = None) -> None:
        self.pid = pid
        self.meta: Mapping[str, Any] = meta or {}  # the snapshot's meta.json (a lean one is refilled by the launcher)
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode: Optional[int] = None
        self.tree = [p for p in tree if p != pid]  # its other processes: orphaned to us (the subreaper) as they die

    def reap_tree(self, wait_s: float = 2.0) -> None:
        """Reap the tree's processes that died orphaned, so that none stays a zombie holding a pid the next
        restore needs (only these pids: never another child's exit status)."""
        deadline = time.monotonic() + wait_s
        left = list(self.tree)
        while left and time.monotonic() < deadline:
            for pid in list(left):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # not ours (reaped by its parent, or never reparented here)
                    done = pid if not pid_alive(pid) else 0
                if done:
                    left.remove(pid)
            time.sleep(0.02)

    def kill_tree(self) -> None:
        """Stop the whole restored tree now (SIGKILL) and reap it: a restored engine that must not serve."""
        _kill([self.pid, *self.tree])
        try:
            self.wait(timeout=10)
        except Exception:  # noqa: BLE001 — reaped or gone either way below
            pass
        self.reap_tree()
        self.stdout.close()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not our child after all: only whether it lives can be told
                done, status = (self.pid, 255 << 8) if not pid_alive(self.pid) else (0, 0)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"restored engine {self.pid}", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def restore(binary: str, folder: Path, work: Path, pid_wait_s: float = 5.0) -> tuple[RestoredEngine, dict]:
    """Restore the snapshot in `folder`; the engine and the restore's phases. SnapshotError/CriuError when it
    cannot (a pid taken, CRIU refusing, the GPU state not restored): nothing of it is left running."""
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    deadline = time.monotonic() + pid_wait_s
    for pid in meta["pids"]:
        while os.path.exists(f"/proc/{pid}"):
            if time.monotonic() > deadline:
                raise SnapshotError(f"pid {pid}, which the snapshot must get back, belongs to a running process")
            time.sleep(0.02)
    cuda = cuda_or_none() if meta["gpu_pids"] else None
    if meta["gpu_pids"] and cuda is None:
        raise SnapshotError("the snapshot holds GPU state but this node has no CUDA driver")
    _, missing = held_files.put_back(folder, meta.get("held", []))  # a node that lacks a held cache file
    if missing:
        raise SnapshotError(missing)
    made = put_back(folder, meta)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the restored tree becomes our child
    read_fd, write_fd = os.pipe()
    inherit = [arg for pipe in meta["pipes"] for arg in ("--inherit-fd", f"fd[{write_fd}]:{pipe}")]
    t0 = time.monotonic()
    try:
        root = criu.restore(binary, folder, work, timeout=300.0, extra=(*DUMP_FLAGS[:3], *inherit),
                            pass_fds=(write_fd,))
    except CriuError:
        os.close(read_fd)
        remove_put_back(made)  # a failed restore may not have consumed them
        raise
    finally:
        os.close(write_fd)
    criu_s = time.monotonic() - t0
    wake_s = 0.0
    try:
        gpu_s = cuda.run(("restore", "unlock"), meta["gpu_pids"]) if cuda is not None else 0.0
        if meta.get("slept") and not meta.get("lean"):  # a lean one waits for its refill (lean_snapshot.py)
            wake_s = _wake_restored(meta)[0]
    except (CudaCheckpointError, SnapshotError, OSError):
        _kill(meta["pids"])
        os.close(read_fd)
        raise
    return RestoredEngine(root, read_fd, meta["pids"], meta), {
        "criu_restore_s": round(criu_s, 3), "gpu_restore_s": round(gpu_s, 3), "wake_s": round(wake_s, 3),
        "bytes": meta.get("bytes"), "gpu_pids": len(meta["gpu_pids"]), "lean": bool(meta.get("lean"))}


LINK_REMAP_NAME = re.compile(r"link_remap\.\d+")


def put_back(folder: Path, meta: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """Put the kept /dev/shm files back where the image expects them; what was created (path, dev, inode).
    Each is a new file (create_own: O_EXCL | O_NOFOLLOW), never written through a name that exists. A name that
    exists and is this user's own regular file: a link-remap file left by an earlier failed restore is replaced,
    a named file is kept (as before). Another user's name, a link or a FIFO: SnapshotError (nothing of this
    restore is left in /dev/shm), and the launch starts the engine as usual."""
    made: list[tuple[str, int, int]] = []
    try:
        for name in meta.get("link_remaps", []):
            if not LINK_REMAP_NAME.fullmatch(name):
                raise SnapshotError(f"meta.json names {name!r} as a link-remap file")
            made += _put(folder / "link-remaps" / name, SHM / name, replace_own=True)
        for path in meta.get("shm_files", []):
            dest = Path(path)
            if os.path.normpath(path) != path or dest.parent == dest or SHM not in dest.parents:
                raise SnapshotError(f"meta.json names {path!r}, which is no file in {SHM}")
            for parent in reversed([p for p in dest.parents if SHM in p.parents]):  # folders in /dev/shm: ours
                why = foreign(os.lstat(parent), is_dir=True)
                if why:
                    raise SnapshotError(f"{parent}, where the restore puts {dest.name} back, {why} — remove it (or "
                                        "ask its owner to); the engine starts as usual meanwhile")
            made += _put(folder / "shm-files" / dest.name, dest, replace_own=False)
    except BaseException:
        remove_put_back(made)
        raise
    return made


def _put(src: Path, dest: Path, replace_own: bool) -> list[tuple[str, int, int]]:
    for attempt in (1, 2):
        try:
            out = create_own(dest)
            break
        except FileExistsError:
            try:
                st = os.lstat(dest)
            except FileNotFoundError:
                continue  # gone meanwhile: try again
            why = foreign(st, is_dir=False)
            if why or attempt == 2:
                raise SnapshotError(f"{dest}, which the restore must create, {why or 'was taken meanwhile'} — remove "
                                    "it (or ask its owner to); the engine starts as usual meanwhile") from None
            if not replace_own:
                return []
            os.unlink(dest)  # ours: in the sticky /dev/shm nobody else can have swapped it since the lstat
    else:
        raise SnapshotError(f"{dest}, which the restore must create, keeps appearing and vanishing")
    try:
        try:
            src_fd = open_own(src)
        except ForeignPath as exc:  # in the private snapshot folder this cannot be: refuse all the same
            raise SnapshotError(exc.one_line()) from None
        try:
            st = os.fstat(src_fd)
            while chunk := os.read(src_fd, 1 << 20):
                os.write(out, chunk)
        finally:
            os.close(src_fd)
        os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o777)
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        mine = os.fstat(out)
    except BaseException:
        os.close(out)
        dest.unlink(missing_ok=True)  # ours: created above with O_EXCL
        raise
    os.close(out)
    return [(str(dest), mine.st_dev, mine.st_ino)]


def remove_put_back(made: Sequence[tuple[str, int, int]]) -> None:
    """Remove what put_back created, each only while the name is still that same file (never another user's
    file that took the name after CRIU consumed ours)."""
    for path, dev, ino in made:
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.unlink(path)
        except OSError:
            continue


def _wake_restored(meta: Mapping[str, Any], action: str = "wake", arg: str = "") -> tuple[float, Any]:
    """Wake (or refill) a restored engine that was snapshotted asleep; the seconds and what it returned. Its
    handler reports into the folder it was given at its first start (gone with that launch's run folder): made
    again for the wake, and removed after."""
    marks = Path(meta["marks"])
    made = [p for p in (*reversed(marks.parents), marks) if not p.exists()]  # outermost first
    for p in made:
        p.mkdir(mode=0o700)
    try:
        return engine_order(int(meta["root"]), marks, action, arg=arg)
    finally:
        if marks in made:
            shutil.rmtree(marks, ignore_errors=True)
        for p in reversed([p for p in made if p != marks]):
            try:
                p.rmdir()  # only while empty: another launch may have put its run folder there meanwhile
            except OSError:
                break


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
