"""A real second user on this machine, for the shared-node attacks (docs/security.md).

The tests run as root in CI; an attacker is a real unprivileged account (`useradd`, made once) whose
commands run through the system Python with its uid and gid alone (no supplementary groups unless a test
names one). What it writes carries its uid, exactly as another user's files in /dev/shm, /tmp or a group
store do. Not root: the tests that need it skip and say why.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pytest

INTRUDER = "mxl-intruder"
SHARED_GROUP = "mxl-shared"
SYSTEM_PYTHON = "/usr/bin/python3"  # the attacker needs only os calls, not the project's venv


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(self, argv: Sequence[str], *, groups: Sequence[int] = (), timeout: float = 60,
            env: Optional[dict[str, str]] = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run argv as this user (its uid and gid; `groups` as its only supplementary groups)."""
        base = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"}
        return subprocess.run(list(argv), user=self.uid, group=self.gid, extra_groups=list(groups),
                              env={**base, **(env or {})}, cwd="/", capture_output=True, text=True,
                              timeout=timeout, check=check)

    def python(self, code: str, *, groups: Sequence[int] = (), timeout: float = 60,
               check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Python snippet (dedented) as this user with the system interpreter."""
        return self.run([SYSTEM_PYTHON, "-c", textwrap.dedent(code)], groups=groups, timeout=timeout, check=check)


def _ensure_user(name: str) -> User:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid)


def ensure_group(name: str = SHARED_GROUP, members: Sequence[str] = ()) -> int:
    """A real group (groupadd once); `members` added to it. Returns its gid."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
        gid = grp.getgrnam(name).gr_gid
    for member in members:
        subprocess.run(["usermod", "-a", "-G", name, member], check=True, capture_output=True)
    return gid


def intruder_or_skip() -> User:
    """The attacker account; skips (saying why) where the tests cannot create users."""
    if os.geteuid() != 0:
        pytest.skip("the shared-node attack tests create a second real user: run them as root (CI does)")
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"{SYSTEM_PYTHON} is missing: the second user's commands run with it")
    return _ensure_user(INTRUDER)


@pytest.fixture
def intruder() -> User:
    return intruder_or_skip()


def tree(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every name under `folder` with its owner, mode and (for files) bytes: what "untouched" is compared by."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(folder))] = (st.st_uid, stat.S_IMODE(st.st_mode),
                                              path.read_bytes() if stat.S_ISREG(st.st_mode) else b"")
    return out
