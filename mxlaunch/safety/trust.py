"""Who may supply code: a file from the store is run, loaded or unpickled only when a trusted writer wrote it.

Kernel-cache archives (Triton launchers are .so files, Inductor's are .py modules and pickles) and zygote images
are code. Anyone who can write a group store could put one under a key another user computes, so what is
restored must come from a writer this user trusts: the user alone by default, root, and the users and groups
named in $MXLAUNCH_TRUSTED_WRITERS (mxlaunch/settings.py). A file is trusted when its owner is such a writer and
nobody else can write it (no write bit for others, and for the group only when that group is trusted: every
member is then a trusted writer). Files are judged by fstat on the descriptor that is then read, never by a
second lookup of the name (docs/security.md).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional

from mxlaunch import settings
from mxlaunch.errors import UsageError
from mxlaunch.safety.ownership import open_judged


@dataclass(frozen=True)
class Writers:
    """The writers whose code this user accepts: uids (this user and root always) and whole groups."""

    uids: frozenset[int]
    gids: frozenset[int] = frozenset()

    def trusts_owner(self, uid: int) -> bool:
        return uid in self.uids or bool(self.gids & _groups_of(uid))

    def why_not(self, st: os.stat_result, what: str, *, is_dir: bool = False, shared_ok: bool = False) -> Optional[str]:
        """Why `what` (a file, or with is_dir a folder) with this stat cannot be trusted as this set's writing,
        or None. A folder may be writable by others when sticky (only an entry's owner can then rename or
        remove it), or when `shared_ok`: the caller checks every entry it reads on its own descriptor."""
        kind_ok = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
        if not kind_ok:
            return f"{what} is not a {'real folder' if is_dir else 'regular file'} (a link or another kind of file)"
        if not self.trusts_owner(st.st_uid):
            return f"{what} was written by {_user(st.st_uid)}, not a trusted writer (MXLAUNCH_TRUSTED_WRITERS)"
        mode = stat.S_IMODE(st.st_mode)
        if is_dir and (shared_ok or mode & stat.S_ISVTX):
            return None
        if mode & 0o002:
            return f"{what} is writable by every user (mode {mode:04o})"
        if mode & 0o020 and st.st_gid not in self.gids:
            return (f"{what} is writable by group {_group(st.st_gid)}, which is not a trusted writer "
                    f"(mode {mode:04o}; MXLAUNCH_TRUSTED_WRITERS)")
        return None

    def describe(self) -> str:
        names = [_user(u) for u in sorted(self.uids - {0})] + [f"%{_group(g)}" for g in sorted(self.gids)]
        return ", ".join(names)


def writers(environ: Mapping[str, str] = os.environ) -> Writers:
    """This user, root, and what $MXLAUNCH_TRUSTED_WRITERS names; UsageError for a name that is no user/group."""
    uids, gids = {os.getuid(), 0}, set()
    for name in settings.trusted_writers(environ):
        if name.startswith("%"):
            gids.add(_resolve(name[1:], grp.getgrnam, "gr_gid", "group"))
        else:
            uids.add(_resolve(name, pwd.getpwnam, "pw_uid", "user"))
    return Writers(frozenset(uids), frozenset(gids))


def _resolve(name: str, lookup, attr: str, kind: str) -> int:  # noqa: ANN001 — getpwnam / getgrnam
    if name.isdigit():
        return int(name)
    try:
        return int(getattr(lookup(name), attr))
    except KeyError:
        raise UsageError(f"MXLAUNCH_TRUSTED_WRITERS names {name!r}, which is no {kind} on this host",
                         "name users (or %groups) that exist, by name or number") from None


@lru_cache(maxsize=256)
def _groups_of(uid: int) -> frozenset[int]:
    """Every group `uid` is in (its primary group and the supplementary ones the host lists)."""
    try:
        entry = pwd.getpwuid(uid)
        return frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except (KeyError, OSError):
        return frozenset()


@lru_cache(maxsize=64)
def private_group(gid: int) -> bool:
    """Is gid this user's private group (its primary group, named like the user, listing no other member)? With
    umask 002 a user's own files are group-writable, and such a group lets no one else write them."""
    try:
        me, group = pwd.getpwuid(os.getuid()), grp.getgrgid(gid)
    except KeyError:
        return False
    return me.pw_gid == gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def open_trusted(path: str | os.PathLike[str], who: Writers, what: str, *, dir_fd: Optional[int] = None,
                 is_dir: bool = False, shared_ok: bool = False) -> tuple[Optional[int], str]:
    """(descriptor, "") of a file (or folder) a trusted writer wrote, opened without following a link and
    without blocking on a FIFO (ownership.open_judged); (None, why) otherwise. FileNotFoundError when it is not
    there."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if is_dir else 0)
    try:
        return open_judged(path, flags, lambda st: who.why_not(st, what, is_dir=is_dir, shared_ok=shared_ok),
                           dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a link; ENOTDIR: not a folder
        return None, f"{what} cannot be opened as a {'real folder' if is_dir else 'regular file'} ({exc.strerror or exc})"
