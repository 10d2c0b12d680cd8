"""Small file and process helpers every part of mxlaunch shares: atomic JSON, folders, permissions, pids.

Files and folders are created with the user's umask, never world-writable; with `MXLAUNCH_GROUP` set they
get that group, g+rw, and folders g+s (see mxlaunch/settings.py). JSON is written to a temp name in the
same folder and appears by rename (or by link, for a publish that only one racer may win): no reader
ever sees half a file.

Private files (`private=True`: P2P records and anything else that lets a peer reach a process's memory)
are readable by the user alone (0600, folders 0700) or, with `MXLAUNCH_GROUP`, by that group too (0640,
folders 2770: the group's members publish beside each other). They are created with that mode (os.open's
mode, fchmod before the first byte), so no reader ever sees one with wider permissions; `exposure()` is the
reader's side: why a file or folder others could have written (or read) must not be trusted.

Names in places other users can write (/dev/shm, /tmp: own_dir, open_own, untrusted_path, ...) are
mxlaunch/safety/ownership.py's: there the shared group never counts, and existing is not being ours.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Any, Optional

from mxlaunch import settings
from mxlaunch.errors import UsageError

MAX_JSON_BYTES = 64 << 20

# ---- files ------------------------------------------------------------


def shared_gid() -> Optional[int]:
    """The group named by MXLAUNCH_GROUP (name or number), or None when unset."""
    name = settings.group()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError as exc:
        raise UsageError(f"MXLAUNCH_GROUP={name} is not a group on this host", "unset it or name a group you are in") from exc


def secure(path: str | os.PathLike[str], *, is_dir: bool) -> None:
    """Drop o+w (never world-writable); with MXLAUNCH_GROUP: that group, g+rw, and g+s on folders."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    new = mode & ~0o002
    gid = shared_gid()
    if gid is not None:
        if st.st_gid != gid:
            try:
                os.chown(path, -1, gid)
            except PermissionError as exc:
                raise UsageError(f"cannot give {path} the group {gid} (MXLAUNCH_GROUP)",
                                 "use a group you are a member of, or unset MXLAUNCH_GROUP") from exc
        new |= 0o060 | (0o2010 if is_dir else 0)
    if new != mode or gid is not None:
        os.chmod(path, new)


def ensure_dir(path: str | os.PathLike[str]) -> Path:
    """mkdir -p; each folder this call creates gets `secure()` (umask, no o+w, optional group)."""
    p = Path(path)
    if p.is_dir():
        return p
    if not p.parent.is_dir() and p.parent != p:
        ensure_dir(p.parent)
    try:
        p.mkdir()
    except FileExistsError:
        if not p.is_dir():
            raise
        return p
    secure(p, is_dir=True)
    return p


def private_mode(*, is_dir: bool) -> int:
    """The mode of a private file or folder: the user alone, or with MXLAUNCH_GROUP that group too (read
    for files, rwx + setgid for folders so that the group's members publish into them)."""
    if shared_gid() is None:
        return 0o700 if is_dir else 0o600
    return 0o2770 if is_dir else 0o640


def _make_private(fd_or_path: int | str | os.PathLike[str], *, is_dir: bool) -> None:
    """Give a file (by descriptor) or folder (by path) the shared group if set, then exactly private_mode()."""
    gid = shared_gid()
    try:
        if gid is not None:
            if isinstance(fd_or_path, int):
                os.fchown(fd_or_path, -1, gid)
            else:
                os.chown(fd_or_path, -1, gid)
    except PermissionError as exc:
        raise UsageError(f"cannot give {fd_or_path} the group {gid} (MXLAUNCH_GROUP)",
                         "use a group you are a member of, or unset MXLAUNCH_GROUP") from exc
    mode = private_mode(is_dir=is_dir)
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)


def ensure_private_dir(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """mkdir -p of `path` below `root` (made as a store folder when missing: ensure_dir): every folder from
    root (excluded) down is made private (0700, or 2770 with MXLAUNCH_GROUP); one of ours found wider is
    narrowed. Raises UsageError for a folder that is a link, or one others could write that we cannot fix."""
    base, target = ensure_dir(root), Path(path)
    rel = target.relative_to(base)
    current = base
    for part in rel.parts:
        current = current / part
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(current)
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{current} is not a real folder", "remove it; the registry makes its own folders")
        want = private_mode(is_dir=True)
        if stat.S_IMODE(st.st_mode) != want and st.st_uid == os.getuid():
            _make_private(current, is_dir=True)
        elif st.st_uid != os.getuid():
            why = exposure(st, is_dir=True)
            if why:
                raise UsageError(f"registry folder {current} {why}", "remove it or ask its owner to")
    return target


def exposure(st: os.stat_result, *, is_dir: bool) -> Optional[str]:
    """Why a private file or folder with this stat must not be trusted (others could have written or, for a
    file, read it), or None. Trusted: owned by this user, or carrying the shared group (MXLAUNCH_GROUP); no
    permission bits for others; group bits only for the shared group (folders: only its write bit counts)."""
    mode = stat.S_IMODE(st.st_mode)
    gid = shared_gid()
    others = mode & (0o002 if is_dir else 0o007)
    group = mode & (0o020 if is_dir else 0o070)
    if st.st_uid != os.getuid() and (gid is None or st.st_gid != gid):
        return f"belongs to uid {st.st_uid}, not this user (uid {os.getuid()}) or the shared group (MXLAUNCH_GROUP)"
    if others:
        return f"is {'writable' if is_dir else 'readable or writable'} by others (mode {mode:04o})"
    if group and (gid is None or st.st_gid != gid):
        shared = "MXLAUNCH_GROUP is not set" if gid is None else f"the shared group is {gid}"
        return f"is open to group {st.st_gid} (mode {mode:04o}) and {shared}"
    return None


def unique_name(prefix: str) -> str:
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def write_json_temp(folder: str | os.PathLike[str], obj: Any, prefix: str = ".", *, private: bool = False) -> Path:
    """Write JSON to a fresh, uniquely named file in `folder` (fsynced, secured); the caller renames or links it.
    private=True: created 0600 and given private_mode() before the first byte is written."""
    tmp = Path(folder) / (unique_name(prefix) + ".tmp")
    payload = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            if private:
                _make_private(fh.fileno(), is_dir=False)
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if not private:
            secure(tmp, is_dir=False)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, exclusive: bool = False,
                      parents: bool = False, private: bool = False) -> bool:
    """Make `path` hold `obj` by one atomic step; nothing half-written is ever visible under `path`.

    exclusive=False replaces what is there (rename). exclusive=True publishes only if `path` does not
    exist yet and returns whether this call won: `link()` fails with EEXIST for every racer but one. On a
    filesystem without hard links an O_EXCL `<path>.lock` decides the single winner instead.
    parents=True creates missing folders first (plain mkdir: run folders in /dev/shm, markers).
    private=True: the file is private from its creation (see private_mode()).
    """
    target = Path(path)
    if parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_json_temp(target.parent, obj, prefix=f".{target.name}.", private=private)
    try:
        if not exclusive:
            os.replace(tmp, target)
            return True
        try:
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
        lock = target.with_name(target.name + ".lock")
        try:
            os.close(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666))
        except FileExistsError:
            return False
        if target.exists():
            return False
        os.replace(tmp, target)
        return True
    finally:
        tmp.unlink(missing_ok=True)


class Exposed(ValueError):
    """A private file others could have written (read_json(private=True)); the message says why."""


def read_json(path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES, *, private: bool = False) -> Any:
    """Read a JSON file of at most `limit` bytes (regular file only). Raises OSError / ValueError;
    private=True also raises `Exposed` for a file others could have written or read (exposure())."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        why = exposure(st, is_dir=False) if private else None
        if why:
            raise Exposed(why)
        if st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        data = fh.read(limit + 1)
    return json.loads(data.decode("utf-8"))


# ---- filesystems ------------------------------------------------------------------------------------------

TMPFS_MAGIC = 0x01021994  # statfs(2) f_type of tmpfs (and /dev/shm)


def is_tmpfs(path: str | os.PathLike[str]) -> bool:
    """Is `path` (which must exist) on tmpfs? statfs(2) through libc: no torch, no mount table."""
    try:
        import ctypes

        buf = (ctypes.c_char * 256)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
        return int.from_bytes(bytes(buf[:8]), "little") == TMPFS_MAGIC
    except (OSError, AttributeError):
        return False


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """`path`, or its nearest parent that exists (a store folder not made yet lives on its parent's filesystem)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


# ---- who am I, is that process alive -------------------------------------------------------------------


LAST_USED = ".last-used"  # in a snapshot's or kernel cache's folder: its mtime is the last launch that used it


def mark_used(folder: str | os.PathLike[str]) -> None:
    """Stamp a store folder as used now (`mxlaunch store prune` removes the least recently used first).
    Never raises: a read-only store is still usable, it only cannot be pruned by use."""
    stamp = Path(folder) / LAST_USED
    try:
        if not Path(folder).is_dir() or Path(folder).is_symlink():
            return
        # never through a planted link (O_NOFOLLOW), never a FIFO or a hard link to another file: only the
        # stamp's own timestamps change, and nothing is opened for writing
        fd = os.open(stamp, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            os.utime(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def last_used(folder: str | os.PathLike[str], fallback: str) -> Optional[float]:
    """When a store folder was last used: its stamp's mtime, else the mtime of `fallback` in it (the
    manifest, the key record: when it was made), else None."""
    for name in (LAST_USED, fallback):
        try:
            return os.lstat(Path(folder) / name).st_mtime
        except OSError:
            continue
    return None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat); 0 when unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """Is `pid` running (not a zombie) and, when start_time is known, still the same process?"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X"):
            return False
        if start_time and int(fields[19]) != start_time:
            return False  # the pid was reused
    except (OSError, ValueError, IndexError):
        pass
    return True
