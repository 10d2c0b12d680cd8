"""What `launch --engine-snapshot` will do, decided for the plan (and the dry run) without writing anything.

Why a module of its own: the run's side (launch/engine_snapshots.py EngineSnapshots) makes the private
snapshots folder and the key's salt on its way; a dry run must only read. So this asks the same questions in
the same order — P2P, CRIU usable, CRIU able to dump a TCP socket on this kernel, the snapshots folder this
user's alone, the key (launch/snapshot_key.py, under the salt when there is one) — and answers with one of:

    restore   this command's snapshot is there: it is restored instead of starting the engine
    take      none yet: the engine starts dumpable and is snapshotted once it serves
    off       why not (the same reason the run's `engine-snapshot status=off` event gives)

`snapshot_blocker` is the host half alone, pure but for `criu --version`: EngineSnapshots could take it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from mxlaunch import settings
from mxlaunch.engine_checkpoint import criu_version, run_quietly, socket_blocker
from mxlaunch.fileutil import ForeignPath, foreign, open_own
from mxlaunch.launch import criu
from mxlaunch.launch.engine_snapshot import META, find, safe_ancestors, snapshots_root
from mxlaunch.launch.snapshot_key import SALT, SALT_BYTES, key_facts, key_of
from mxlaunch.launch.zygote import private_dir


def snapshot_blocker(environ: Mapping[str, str] = os.environ) -> tuple[Optional[str], str]:
    """(the criu to run, "") when this launcher can snapshot an engine (CRIU 4+ usable here, and able to dump
    the engine's TCP socket on this kernel); else (None, why not)."""
    binary, why = criu.why_not(environ)
    if binary is None:
        return None, why
    why = socket_blocker(criu_version(run_quietly([binary, "--version"])), os.uname().release) or ""
    return (None, why) if why else (binary, "")


def folder_problem(root: Path) -> Optional[str]:
    """Why the snapshots folder `root` could not be used ("problem — fix"), judged without making it: every
    folder above it this user's or root's and writable by nobody else (or sticky), and itself, when there, a
    real folder of this user's that nobody else can enter (engine_snapshot.own_root's rules)."""
    above = root.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    try:
        safe_ancestors(above)
        if os.path.lexists(root):
            why = foreign(os.lstat(root), is_dir=True)
            if why:
                return f"{root} {why} — remove it, or point {settings.ENGINE_SNAPSHOTS} at a folder of yours"
            if not private_dir(root):
                return f"{root} is open to others (mode {os.lstat(root).st_mode & 0o777:04o}) — chmod 700 {root}"
    except ForeignPath as exc:
        return exc.one_line()
    except OSError as exc:
        return f"the engine snapshots' folder: {exc.strerror or exc}"
    return None


def read_salt(root: Path) -> Optional[bytes]:
    """This user's salt for the key, or None when none was made yet (then no snapshot can be there either).
    ValueError for one of the wrong size (the run refuses it the same way)."""
    try:
        fd = open_own(root / SALT)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        salt = fh.read(SALT_BYTES + 1)
    if len(salt) != SALT_BYTES:
        raise ValueError(f"{root / SALT} holds {len(salt)} bytes, not {SALT_BYTES}: remove it (the next launch makes "
                         "a new one)")
    return salt


def plan_engine_snapshot(argv: Sequence[str], source_id: str, environ: Mapping[str, str] = os.environ,
                         p2p: bool = False, cwd: Optional[str] = None) -> Dict[str, Any]:
    """The plan's "engine_snapshot": status (restore | take | off), reason, and key and path where known."""
    if p2p:
        return {"status": "off", "reason": "P2P starts are not snapshotted"}
    binary, why = snapshot_blocker(environ)
    if binary is None:
        return {"status": "off", "reason": why}
    root = snapshots_root(environ)
    why = folder_problem(root)
    if why:
        return {"status": "off", "reason": why}
    try:
        salt = read_salt(root) if root.is_dir() else None
    except (ForeignPath, OSError, ValueError) as exc:
        return {"status": "off", "reason": exc.one_line() if isinstance(exc, ForeignPath) else
                f"the engine snapshots' folder: {exc}"}
    take = ("the engine starts dumpable (no io_uring) and, once it serves (and a capture is published), is "
            f"snapshotted into {root} — it pauses for the dump")
    if salt is None:
        return {"status": "take", "reason": f"no snapshot for this command yet: {take}", "key": None,
                "path": str(root)}
    key = key_of(key_facts(list(argv), source_id, environ, salt, os.getcwd() if cwd is None else cwd))
    folder = find(root, key)
    if folder is None:
        return {"status": "take", "reason": f"no snapshot for this command yet: {take}", "key": key,
                "path": str(root / key)}
    size = _bytes(folder)
    return {"status": "restore", "key": key, "path": str(folder), "bytes": size,
            "reason": "this command's snapshot is restored instead of starting the engine"
                      f"{f' ({size / 2**30:.1f} GiB)' if size else ''}; should the restore fail, the engine starts "
                      "as planned"}


def _bytes(folder: Path) -> Optional[int]:
    try:
        size = json.loads((folder / META).read_text(encoding="utf-8")).get("bytes")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) else None
