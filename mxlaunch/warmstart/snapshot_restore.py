"""Restoring an engine snapshot: the files it needs put back, `criu restore -d` with a new output pipe, the GPU
state restored, the engine woken; and the restored tree driven like the Popen of a spawned engine.

Why a module of its own: a restore runs where another user may have taken a name first (/dev/shm is every
user's: docs/security.md), so putting files back (put_back: new names only, O_EXCL | O_NOFOLLOW, removed again
on any failure) and the restore are one job with one rule — nothing of a refused restore is left behind, and
the launcher starts the engine as usual.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from mxlaunch.fileutil import pid_alive
from mxlaunch.safety.ownership import ForeignPath, create_own, foreign, open_own
from mxlaunch.warmstart import criu, held_files
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpointError
from mxlaunch.warmstart.engine_snapshot import DUMP_FLAGS, META, SHM, SnapshotError, cuda_or_none
from mxlaunch.warmstart.engine_tree import engine_order

PR_SET_CHILD_SUBREAPER = 36


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
