"""Names in shared places (/dev/shm, /tmp, a group store) that are this user's own: made private, or checked
(real folder or regular file, this uid, writable by nobody else, no link, no FIFO) before they are used.

Why a module of its own: in a place other users can write, existing is not being ours — another user may have
made the name first, or planted a link or a FIFO under it — so every such name is judged on its lstat or on the
descriptor that is then used, never by a second lookup (docs/security.md). fileutil's folders and JSON files
are the other side: the store's own names, made with the user's umask and an optional shared group. This module
stands on nothing of ours but errors, so fileutil, trust and every side may import it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Optional

from mxlaunch.errors import UsageError


class ForeignPath(UsageError):
    """A name in a shared place (/dev/shm, /tmp, a store) that is not this user's own: another user made it
    first, it is a link, or others can write it. The message names the path and the fix."""


def own_dir(path: str | os.PathLike[str], *, mode: int = 0o700) -> Path:
    """A folder in a shared place that only this user controls: made with `mode` when missing; one that exists
    must be a real folder (lstat: no symbolic link), owned by this uid and writable by nobody else (group or
    others), or ForeignPath is raised. Callers either fall back to a private name or stop with its one line.
    Why not ensure_dir: in /dev/shm or /tmp anyone may create the name first, so existing is not being ours."""
    p = Path(path)
    try:
        os.mkdir(p, mode)
        os.chmod(p, mode)  # the umask may have narrowed it; never wider than asked
    except FileExistsError:
        pass
    st = os.lstat(p)
    why = foreign(st, is_dir=True)
    if why:
        raise ForeignPath(f"{p} {why}", f"remove it (or ask its owner to), or point mxlaunch elsewhere")
    return p


def private_dir(path: str | os.PathLike[str]) -> bool:
    """Is `path` a real folder of this user's that nobody else can enter (lstat: a link is not)?"""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def foreign(st: os.stat_result, *, is_dir: bool) -> Optional[str]:
    """Why a file or folder in a shared place is not this user's own (None when it is): not the expected
    kind (a link, a FIFO, ...), another owner, or writable by group or others. Stricter than exposure():
    no shared group counts here, because these names are the user's private working state."""
    kind_ok = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"is not a {'real folder' if is_dir else 'regular file'} (a link or another kind of file)"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not this user (uid {os.getuid()})"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def untrusted_path(path: str | os.PathLike[str], *, is_dir: bool) -> Optional[str]:
    """Why `path` in a shared place may be in another user's hands (None when it is not): it must be this
    user's own (foreign()), and every folder above it (links resolved) must belong to root or this user and be
    writable by nobody else, unless sticky (/dev/shm, /tmp: there only an entry's owner may rename or remove it).
    Why the folders too: whoever can write a folder above a file can swap the file under its name."""
    p = Path(path)
    try:
        why = foreign(os.lstat(p), is_dir=is_dir)
        if why:
            return f"{p} {why}"
        parent = Path(os.path.realpath(p.parent))
        for folder in (parent, *parent.parents):
            st = os.lstat(folder)
            mode = stat.S_IMODE(st.st_mode)
            if not stat.S_ISDIR(st.st_mode):
                return f"{folder} is not a real folder"
            if st.st_uid not in (0, os.getuid()):
                return f"{folder} belongs to uid {st.st_uid}, not this user (uid {os.getuid()}) or root"
            if mode & 0o022 and not mode & stat.S_ISVTX:
                return f"{folder} is writable by others (mode {mode:04o})"
    except OSError as exc:
        return f"{p} cannot be checked ({exc.strerror or exc})"
    return None


def own_root(parent: str | os.PathLike[str], name: str, *, create: bool = True) -> tuple[Optional[Path], Optional[str]]:
    """This user's folder `name` in a shared place (`parent`: /dev/shm), and why the name itself was not used
    (None when it was). `name` is used when it is this user's own (own_dir); when another user took it first (or
    it is a link, or writable by others), a private fallback `name.XXXXXXXX` of this user's is: the first one
    there (every launch of this user on the node agrees on it), else a new one (mkdtemp: a random name, 0700).
    create=False makes nothing: (None, why) when neither is there. ForeignPath when `parent` is writable by
    everyone without the sticky bit (then anyone could rename this user's folders there)."""
    base = Path(parent)
    mode = os.stat(base).st_mode
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise ForeignPath(f"{base} is writable by everyone without the sticky bit, so any user could rename "
                          "mxlaunch's folders there", f"ask the node's admin to `chmod +t {base}`")
    primary = base / name
    try:
        if create:
            return own_dir(primary), None
        why = foreign(os.lstat(primary), is_dir=True)
        if why is None:
            return primary, None
        why = f"{primary} {why}"
    except ForeignPath as exc:
        why = exc.message
    except FileNotFoundError:
        why = None
    found = own_fallbacks(base, name)
    if found:
        return found[0], why
    if not create:
        return None, why
    import tempfile  # noqa: PLC0415

    return Path(tempfile.mkdtemp(prefix=f"{name}.", dir=base)), why


def own_fallbacks(parent: str | os.PathLike[str], name: str) -> list[Path]:
    """The fallbacks own_root made for `name` (`name.XXXXXXXX`) that are this user's own, sorted; names of
    that shape another user made (or links) are never listed."""
    found = []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    for entry in entries:
        if not entry.startswith(f"{name}."):
            continue
        try:
            if foreign(os.lstat(Path(parent) / entry), is_dir=True) is None:
                found.append(Path(parent) / entry)
        except OSError:
            continue
    return found


Judge = Callable[[os.stat_result], Optional[str]]  # why a descriptor's stat must not be used, or None


def open_judged(path: str | os.PathLike[str], flags: int, judge: Judge, *, mode: int = 0o777,
                dir_fd: Optional[int] = None) -> tuple[Optional[int], str]:
    """The one way to open a name someone else may have planted: never through a symbolic link (O_NOFOLLOW),
    never blocking on a FIFO (O_NONBLOCK until judged), and judged by `judge` on the descriptor's own fstat, never
    by a second lookup of the name. (descriptor, "") blocking again, or (None, why) with the descriptor closed.
    The callers keep their own rules (foreign(), trust.Writers.why_not, the log's owner check) and their own
    answer to a refusal; an OSError of the open itself (ELOOP for a link, ENOENT, ...) is theirs too."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        why = judge(os.fstat(fd))
        if not why:
            os.set_blocking(fd, True)
            return fd, ""
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None, why


def open_own(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """os.open for a file in a shared place: never through a symbolic link (O_NOFOLLOW), never a FIFO
    (O_NONBLOCK until checked), and only a regular file of this user's that others cannot write;
    ForeignPath otherwise. Returns the descriptor (blocking again)."""
    fd, why = open_judged(path, flags, lambda st: foreign(st, is_dir=False))
    if fd is None:
        raise ForeignPath(f"{path} {why}", "remove it (or ask its owner to); mxlaunch will not use it")
    return fd


def create_own(path: str | os.PathLike[str], *, mode: int = 0o600) -> int:
    """A new file that did not exist before (O_CREAT | O_EXCL | O_NOFOLLOW): a planted name or link makes it
    fail with FileExistsError instead of writing through it. Returns a write descriptor."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
