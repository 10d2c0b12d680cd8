"""Zygote images: the pre-imported zygote dumped once by CRIU, restored on a node's next first start.

A `--zygote` restart forks from a warm interpreter, but a node's *first* start still imports the engine
(~20 s for vLLM's API server on the H200 machine). CRIU restores an imported interpreter in 0.3–0.6 s
(docs/benchmarks.md), so the first zygote a launcher starts is dumped into the store once it has imported,
and every later start that finds no zygote waiting restores that image instead of importing.

Layout, under the store's root (a node-local mirror for an S3 store):

    zygote-images/<uid>/            0700, this user's alone: an image is this user's memory (its environment,
                                    tokens included) and restoring one runs it, so no other user's is ever used
        <key>/                      one per zygote key (warmstart/zygote.py: interpreter, engine, entry, folder,
            meta.json               environment); published by renaming a finished temp folder
            *.img                   CRIU's files
        .<key>.<pid>.tmp/           a dump in progress

The flow (the plugin's half is plugin/zygote_dump.py `await_image`):
- after ready, `ImageMaker` starts the zygote with --image-log; once it stands still (`<key>.dumpable`), the
  maker claims it, dumps it (CRIU stops it), publishes the image and restores it at once to serve this node;
- a later start with no zygote: `restore_zygote` writes `<key>.resume` (where to log), restores the image and
  waits for the socket. Any failure (the pid is taken here, a library changed size, no capability) is a
  `CriuError`, and the launcher spawns as always.

Restoring an image runs it, so only this user's own image is ever restored (an image also holds its writer's
environment: MXLAUNCH_TRUSTED_WRITERS does not widen this). `open_image` opens <uid>/ and <key>/ without
following links and judges them and every file in the image on their descriptors; CRIU is then given the
folder through that descriptor (/proc/self/fd/N), so a folder renamed in its place after the check (a group
store's members may rename what is above <uid>/) is never what CRIU reads. Something there that fails the
check is refused: one `zygote-image` event with the reason, and the engine is spawned as always.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from mxlaunch.fileutil import mark_used, pid_alive
from mxlaunch.contract import ZYGOTE_DUMPABLE, ZYGOTE_DUMPING, ZYGOTE_RESUME
from mxlaunch.warmstart import criu, snapshot_key, working_set, zygote
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.image_sums import SUMS, check_sums, write_sums
from mxlaunch.warmstart.image_stage import ImageDamaged, NoRoom, remove_copy, stage_image, staging_root
from mxlaunch.store.zygote_images import META, image_dir, images_root  # the layout, below the store's prune

private = zygote.private_dir  # an image is restored, and dumped into, only from a folder this user alone controls


def key_salt(store_root: Path) -> bytes:
    """This user's salt for the zygote key's digests (warmstart/zygote.py zygote_key), kept beside the images
    (`<uid>/key-salt`, snapshot_key.key_salt) so that every node using this store makes the same keys; b""
    (plain digests) when that folder cannot be this user's alone."""
    root = images_root(store_root)
    try:
        root.mkdir(parents=True, mode=0o700, exist_ok=True)
        return snapshot_key.key_salt(root) if private(root) else b""
    except (OSError, ValueError):
        return b""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_image(store_root: Path, key: str) -> tuple[Optional[int], str]:
    """A descriptor of the published image for `key` (the caller closes it): (fd, ""); (None, "") when there is
    none; (None, why) when something is there that must not be restored (not this user's alone, a link, a file
    another user wrote or could write)."""
    root = images_root(store_root)
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"{root} is not a real folder ({exc.strerror or exc})"
    try:
        st = os.fstat(root_fd)
        if not os.path.lexists(root / key):
            return None, ""
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None, (f"{root} is not a folder of this user's alone (uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): no image in it is restored")
        try:
            fd = os.open(key, _DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            return None, ""
        except OSError as exc:
            return None, f"{root / key} is not a real folder ({exc.strerror or exc})"
    finally:
        os.close(root_fd)
    why = _foreign_in(fd, root / key)
    if why is None and not _is_file(fd, META):
        why = ""  # not published (a dump renames a finished folder into place): no image
    if why is not None:
        os.close(fd)
        return None, why
    return fd, ""


def _foreign_in(fd: int, folder: Path) -> Optional[str]:
    """Why the image folder (open as fd) or a file in it is not this user's own, or None."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"{folder} belongs to uid {st.st_uid} or others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return f"{folder / name} is not a file of this user's alone (uid {st.st_uid}, mode {st.st_mode:o})"
    return None


def _is_file(fd: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def check_image(store_root: Path, key: str) -> tuple[Optional[Path], str]:
    """(folder, "") for a usable image; (None, "") when there is none; (None, why) when one is refused."""
    fd, why = open_image(store_root, key)
    if fd is None:
        return None, why
    os.close(fd)
    return image_dir(store_root, key), ""


def find_image(store_root: Path, key: str) -> Optional[Path]:
    """The published image for `key`, if one is there in a folder only this user controls."""
    return check_image(store_root, key)[0]


def _marker(key: str, suffix: str) -> Path:
    return zygote.zygote_root() / f"{key}{suffix}"


def write_resume(key: str, log: Path, restored: bool) -> None:
    """Let a standing zygote go on, logging to `log`: a restored copy (written before the restore: it waits
    for this file), or the original that will not be dumped (restored=False: a failed dump, a stopped launcher)."""
    path = _marker(key, ZYGOTE_RESUME)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"log": str(log), "restored": restored}), encoding="utf-8")
    os.replace(tmp, path)


def wait_for_socket(key: str, pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not zygote.socket_path(key).exists():
        if not pid_alive(pid):
            raise CriuError(f"the restored zygote (pid {pid}) exited before it served")
        if time.monotonic() > deadline:
            raise CriuError(f"the restored zygote (pid {pid}) published no socket in {timeout:.0f} s")
        time.sleep(0.005)


def restore_zygote(binary: str, store_root: Path, key: str, log: Path, work: Path, timeout: float = 30.0,
                   stage_root: Optional[Path] = None) -> dict:
    """Restore the image for `key` and wait until it serves: {"pid", "restore_s", "image"}; CriuError when
    there is no usable image or CRIU refuses (the caller spawns as always). `stage_root`: a private folder
    (the run folder in /dev/shm) the image is staged into and checked as it lands (warmstart/image_stage.py)
    before CRIU reads the copy; without it, or without room there, CRIU reads the store's folder, checked first."""
    fd, why = open_image(store_root, key)
    if fd is None:
        raise CriuError(f"image refused: {why}" if why else "no image for this zygote yet")
    folder, by_fd = image_dir(store_root, key), Path(f"/proc/self/fd/{fd}")
    try:
        zygote.zygote_root().mkdir(mode=0o700, exist_ok=True)
        blocked = zygote.image_blocker()  # the image's zygote listens under the usual name: it must be this user's
        if blocked:
            raise CriuError(blocked)
        if not zygote.private_root():
            raise CriuError(f"{zygote.zygote_root()} is not a folder of this user's alone")
        t0 = time.monotonic()
        _wait_pid_free(_pid_in(by_fd / META), 5.0)  # before a byte is copied: a pid in use refuses the image
        ahead = _read_ahead(by_fd / META)  # the zygote's library pages, read while the image stages
        copy, staged = _staged_or_checked(by_fd, folder, stage_root)
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            write_resume(key, log, restored=True)
            # CRIU reads what was checked: the private copy, or the store's folder through its descriptor
            pid = criu.restore(binary, copy or by_fd, work, timeout, pass_fds=() if copy else (fd,))
        except BaseException:
            _marker(key, ZYGOTE_RESUME).unlink(missing_ok=True)
            raise
        finally:
            remove_copy(copy)  # read by CRIU (its pages are the restored zygote's memory now), or not needed
        try:
            wait_for_socket(key, pid, timeout)
        except CriuError:
            _marker(key, ZYGOTE_RESUME).unlink(missing_ok=True)
            raise
    finally:
        os.close(fd)
    mark_used(folder)  # `store prune` removes the least recently used first
    return {"pid": pid, "restore_s": round(time.monotonic() - t0, 3), "image": str(folder), **staged,
            **({"read_ahead": ahead.result(timeout=0)} if ahead is not None else {})}


def _read_ahead(meta: Path) -> Optional[working_set.ReadAhead]:
    """The read-ahead of the pages the dumped zygote had touched (its meta.json), started now."""
    try:
        doc = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return working_set.start(doc) if isinstance(doc, dict) else None


def _staged_or_checked(by_fd: Path, folder: Path, stage_root: Optional[Path]) -> tuple[Optional[Path], dict]:
    """The image staged into `stage_root` and checked as it landed (the copy, its stage's numbers), or (None,
    {}) once the store's folder passed its sums in place (no room, no stage root, an image made before sums).
    CriuError for a damaged image."""
    if not (by_fd / SUMS).exists():  # an image made before sums: as it is
        return None, {}
    root = staging_root(stage_root)
    try:
        if root is not None:
            return stage_image(by_fd, root)
    except ImageDamaged as exc:
        raise CriuError(f"image refused: {folder} is damaged: {exc}") from None
    except NoRoom:
        pass  # restored from the store, checked in place first
    damaged = check_sums(by_fd)
    if damaged:
        raise CriuError(f"image refused: {folder} is damaged: {damaged}")
    return None, {}


class ImageMaker(threading.Thread):
    """Dumps a freshly started zygote (started with --image-log) into the store and restores it to serve.

    Runs beside the serving engine, in the launcher: the zygote imports for tens of seconds first. `emit`
    reports one `zygote-image` event: status published (dump_s, restore_s, bytes) or failed (reason) — or, when
    the launcher stops first and the maker does not end within abandon's wait, abandoned (said by `abandon`,
    and nothing after it: the launcher's `exit` event is its last)."""

    def __init__(self, binary: str, pid: int, key: str, store_root: Path, log: Path, work: Path,
                 emit: Callable[..., None], wait_s: float = 600.0) -> None:
        super().__init__(name="mx-zygote-image", daemon=True)
        self.binary, self.pid, self.key = binary, pid, key
        self.store_root, self.log, self.work = Path(store_root), log, work
        self.emit = emit
        self.wait_s = wait_s
        self.result: Optional[dict] = None
        self._lock = threading.Lock()
        self._claimed = False
        self._abandoned = False
        self._quiet = False  # abandoned and said so: the maker reports nothing more

    def abandon(self, wait_s: float = 5.0) -> None:
        """The launcher is stopping. Unclaimed: tell the zygote (now, or once it has imported) that nobody dumps
        it, so it serves as a plain zygote instead of waiting out --image-wait-s. Claimed: let the dump and
        restore (about a second) finish. Either way the maker's own event comes now, within wait_s; a maker
        still at work then is reported abandoned, and says nothing more."""
        with self._lock:
            self._abandoned = True
            claimed = self._claimed
        if not claimed:
            write_resume(self.key, self.log, restored=False)
        if self.is_alive():
            self.join(wait_s)
        with self._lock:
            if self.is_alive():
                self._quiet = True
                self.emit("zygote-image", status="abandoned", key=self.key,
                          reason=f"the launcher stopped with the zygote's dump still under way after {wait_s:g} s: "
                                 "no image from this run")

    def _say(self, **fields: object) -> None:
        with self._lock:
            if not self._quiet:
                self.emit("zygote-image", key=self.key, **fields)

    def run(self) -> None:
        try:
            self.result = self._make()
            self._say(status="published", **self.result)
        except CriuError as exc:
            self.result = {"error": str(exc)}
            self._say(status="failed", reason=str(exc))

    def _make(self) -> dict:
        dumpable, dumping = _marker(self.key, ZYGOTE_DUMPABLE), _marker(self.key, ZYGOTE_DUMPING)
        deadline = time.monotonic() + self.wait_s
        while _pid_in(dumpable) != self.pid:  # a marker of another pid is a dead zygote's: not ours to dump
            if self._abandoned:
                raise CriuError("the launcher stopped before the zygote had imported: it serves without an image")
            if not pid_alive(self.pid):
                raise CriuError("the zygote exited before it had imported (see zygote.log)")
            if time.monotonic() > deadline:
                raise CriuError(f"the zygote did not finish importing in {self.wait_s:.0f} s")
            time.sleep(0.05)
        why = _undumpable_in(dumpable)
        if why:
            dumpable.unlink(missing_ok=True)
            raise CriuError(f"the zygote cannot be dumped: {why}")
        with self._lock:
            if self._abandoned:
                raise CriuError("the launcher stopped before the zygote had imported: it serves without an image")
            try:
                os.rename(dumpable, dumping)  # the claim: from here the zygote waits for a restore or a resume file
            except FileNotFoundError:
                raise CriuError("the zygote stopped waiting for its dump") from None
            self._claimed = True
        root = images_root(self.store_root)
        root.mkdir(parents=True, mode=0o700, exist_ok=True)
        if not private(root):
            write_resume(self.key, self.log, restored=False)
            dumping.unlink(missing_ok=True)
            raise CriuError(f"{root} is not a folder of this user's alone (mode 0700): not dumping into it")
        tmp = root / f".{self.key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        touched = working_set.record([self.pid])  # the pages it touched while importing: read ahead at a restore
        t0 = time.monotonic()
        try:
            criu.dump(self.binary, self.pid, tmp)
        except CriuError:
            shutil.rmtree(tmp, ignore_errors=True)
            write_resume(self.key, self.log, restored=False)  # CRIU let it run on: it goes on as a plain zygote
            dumping.unlink(missing_ok=True)
            raise
        finally:
            dumping.unlink(missing_ok=True)
        dump_s = time.monotonic() - t0
        _reap(self.pid)  # the restore needs its pid free: no zombie may hold it
        size = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
        (tmp / META).write_text(json.dumps({"key": self.key, "pid": self.pid, "bytes": size, "made": time.time(),
                                            "kernel": os.uname().release, "working_set": touched}), encoding="utf-8")
        write_sums(tmp)  # the image travels (other nodes and jobs read it from the store): checked before each restore
        final = image_dir(self.store_root, self.key)
        try:
            os.rename(tmp, final)
        except OSError:  # another launcher published one first: use that one
            shutil.rmtree(tmp, ignore_errors=True)
        restored = restore_zygote(self.binary, self.store_root, self.key, self.log, self.work)
        return {"dump_s": round(dump_s, 3), "restore_s": restored["restore_s"], "bytes": size, "pid": restored["pid"],
                "image": restored["image"]}


def _pid_in(path: Path) -> Optional[int]:
    """The "pid" of a JSON file (a zygote's .dumpable marker, an image's meta.json), or None."""
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _undumpable_in(marker: Path) -> Optional[str]:
    """A zygote that cannot be dumped (it holds GPU device files) says why in its marker and does not wait."""
    try:
        why = json.loads(marker.read_text(encoding="utf-8")).get("undumpable")
    except (OSError, ValueError, AttributeError):
        return None
    return str(why) if why else None


def _wait_pid_free(pid: Optional[int], timeout: float) -> None:
    """A restore recreates the image's pid: wait briefly for a zygote that is exiting (its socket removed, it
    leaves within 2 s), and refuse at once, naming it, when another process holds that pid."""
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            raise CriuError(f"pid {pid}, which the image must get back, belongs to a running process on this node")
        time.sleep(0.02)


def _reap(pid: int, timeout: float = 10.0) -> None:
    """Reap our dumped child (or wait until whoever else reaps it has) so that /proc/<pid> is gone."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
