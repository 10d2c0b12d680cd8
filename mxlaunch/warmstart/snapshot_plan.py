"""What `launch --engine-snapshot` will do, decided for the plan (and the dry run) without writing anything.

Why a module of its own: the run's side (warmstart/engine_snapshots.py EngineSnapshots) makes the private
snapshots folder and the key's salt on its way; a dry run must only read. So this asks the same questions in
the same order — P2P, CRIU usable, CRIU able to dump a TCP socket on this kernel, the snapshots folder this
user's alone (node-local, or the store's for a lean snapshot: snapshots_env), the key (warmstart/snapshot_key.py,
under the salt when there is one), whether a lean snapshot found can serve this plan — and answers with one of:

    restore   this command's snapshot is there: it is restored instead of starting the engine
    take      none yet: the engine starts dumpable and is snapshotted once it serves
    off       why not (the same reason the run's `engine-snapshot status=off` or `skipped` event gives)

`snapshot_blocker` (the host half) and `snapshots_env` (where the snapshots live) are pure but for
`criu --version`: EngineSnapshots could take them too, so that the two cannot drift.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from mxlaunch import settings
from mxlaunch.warmstart.engine_checkpoint import criu_version, run_quietly, socket_blocker
from mxlaunch.warmstart import criu, lean_snapshot
from mxlaunch.warmstart.engine_snapshot import META, find, safe_ancestors, snapshots_root
from mxlaunch.warmstart.engine_snapshots import STORE_FOLDER
from mxlaunch.warmstart.image_sums import SUMS
from mxlaunch.warmstart.snapshot_key import SALT, SALT_BYTES, key_facts, key_of
from mxlaunch.warmstart.zygote import private_dir
from mxlaunch.safety.ownership import ForeignPath, foreign, open_own


def snapshots_env(environ: Mapping[str, str], store_root: Optional[Path]) -> Mapping[str, str]:
    """The environment whose snapshots_root() is where this launch's snapshots live: a lean one (no weights, a
    few GB) in the local artifact store (`store_root`), unless $MXLAUNCH_ENGINE_SNAPSHOTS names a folder; a full
    one node-local (warmstart/engine_snapshots.py EngineSnapshots.root_env)."""
    if settings.snapshot_sleep(environ) == 2 and store_root is not None and not settings.engine_snapshots(environ):
        return {**environ, settings.ENGINE_SNAPSHOTS: str(Path(store_root) / STORE_FOLDER)}
    return environ


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
                         p2p: bool = False, cwd: Optional[str] = None, store_root: Optional[Path] = None,
                         strategy: str = "staged") -> Dict[str, Any]:
    """The plan's "engine_snapshot": status (restore | take | off), reason, and key and path where known.
    store_root: a local store's root (None for an S3 store); strategy: the plan's (a lean snapshot needs staged)."""
    if p2p:
        return {"status": "off", "reason": "P2P starts are not snapshotted"}
    binary, why = snapshot_blocker(environ)
    if binary is None:
        return {"status": "off", "reason": why}
    root = snapshots_root(snapshots_env(environ, store_root))
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
    meta = _meta(folder)
    why = lean_snapshot.why_not_restore(meta, strategy)
    if why:  # the run skips it, and takes no other while it is there
        return {"status": "off", "key": key, "path": str(folder),
                "reason": f"this command's snapshot is not restored ({why}), and no other is taken while it is there"}
    size = meta.get("bytes") if isinstance(meta.get("bytes"), int) else None
    checked = "; its sums are checked first" if (folder / SUMS).exists() else ""
    return {"status": "restore", "key": key, "path": str(folder), "bytes": size,
            "reason": "this command's snapshot is restored instead of starting the engine"
                      f"{f' ({size / 2**30:.1f} GiB)' if size else ''}{checked}; should the restore fail, the "
                      "engine starts as planned"}


def _meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
