"""Files an engine snapshot's processes hold open or mapped: recorded at the dump, put back where a node lacks them.

Why: CRIU reopens every file the dumped processes held, by path. On the node that took the snapshot they are
all there; on a wiped node or another node — where a lean snapshot from the store is meant to be restored
(warmstart/lean_snapshot.py) — the node-local ones are not: the H200 run of 2026-12-04 failed its restore on a
wiped node with CRIU's "Unable to open fd=90", a file in a JIT cache the CUDA driver or a kernel library keeps
open. So the dump records each such regular file, keeps a copy of the small ones that are not part of the
software (the caches in the user's home or /tmp), and a restore puts a kept copy back only where the path is
missing (a new file, O_EXCL | O_NOFOLLOW, in folders made 0700), or names the missing file in its one-line
reason when there is no copy: then the engine starts as usual.

/dev/shm files are warmstart/engine_tree.py's (shm_files); deleted files are CRIU's own (link-remaps).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mxlaunch.safety.ownership import create_own

FOLDER = "held-files"
COPY_LIMIT = 64 << 20  # a cache's index or lock file; anything larger is expected on the node (the software, the model)
SYSTEM = ("/dev/", "/proc/", "/sys/", "/usr/", "/lib/", "/lib64/", "/bin/", "/sbin/", "/etc/", "/opt/", "/run/")


def _software_roots() -> tuple[str, ...]:
    """Where the interpreter and its packages live: the same software is part of the snapshot's key."""
    cwd = os.getcwd()
    roots = {sys.prefix, sys.base_prefix, *(p for p in sys.path if p and os.path.isdir(p) and os.path.abspath(p) != cwd)}
    return tuple(str(Path(r).resolve()) + "/" for r in roots if r)


def held_paths(pids: Sequence[int], opened: Any, mapped: Any) -> list[str]:
    """The regular files `pids` hold open (`opened(pid)`) or mapped (`mapped(pid)`) that still have a name,
    outside /dev/shm: sorted, each once."""
    names = {f for p in pids for f in (*opened(p), *mapped(p))}
    out = []
    for name in sorted(names):
        if not name.startswith("/") or name.endswith(" (deleted)") or name.startswith("/dev/"):
            continue
        try:
            st = os.stat(name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(name)
    return out


def record(paths: Iterable[str], folder: Path) -> list[dict]:
    """Record each held file; copy the small ones outside the system and the software into folder/held-files."""
    software = _software_roots()
    held: list[dict] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        size = st.st_size
        entry: dict = {"path": path, "bytes": size, "mode": stat.S_IMODE(st.st_mode)}  # CRIU checks the mode too
        if size <= COPY_LIMIT and not path.startswith(SYSTEM) and not path.startswith(software):
            keep = folder / FOLDER / str(len(held))
            keep.parent.mkdir(mode=0o700, exist_ok=True)
            try:
                shutil.copyfile(path, keep, follow_symlinks=False)
                os.chmod(keep, 0o600)
                entry["copy"] = f"{FOLDER}/{keep.name}"
            except OSError:
                pass  # unreadable now: the restore then needs it on the node, and says so if it is missing
        held.append(entry)
    return held


def put_back(folder: Path, held: Sequence[Mapping[str, Any]]) -> tuple[list[str], str]:
    """Put kept copies back where their path is missing; (paths made, why not "" or the first missing file that
    has no copy). Nothing that exists is touched; a name that another user made (on a new node, a cache path
    may be squatted before the first restore) refuses the restore: CRIU would reopen or map it in the engine."""
    made: list[str] = []
    for entry in held:
        path = Path(str(entry.get("path", "")))
        if not path.is_absolute():
            continue
        try:
            owner = os.lstat(path).st_uid
        except FileNotFoundError:
            owner = None
        if owner is not None:
            if owner not in (0, os.getuid()):
                return made, f"{path}, which the image holds open, belongs to uid {owner}: not restoring into it"
            continue
        copy = entry.get("copy")
        if not copy or "/" not in str(copy) or ".." in str(copy):
            return made, f"the image holds {path} open, and this node has no such file"
        try:
            _make_parents(path.parent)
            fd = create_own(path)
            os.fchmod(fd, int(entry.get("mode", 0o600)) & 0o755)  # never writable by others, whatever was recorded
            with os.fdopen(fd, "wb") as out, open(folder / str(copy), "rb") as src:
                shutil.copyfileobj(src, out)
            made.append(str(path))
        except OSError as exc:
            return made, f"cannot put back {path}, which the image holds open: {exc.strerror or exc}"
    return made, ""


def _make_parents(folder: Path) -> None:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        made.mkdir(mode=0o700)
