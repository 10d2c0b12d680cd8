"""Can an engine command start on this machine, and which environment's engine would it run?

Asked before anything is spawned, so that a command that cannot start ends in one line and exit 2
(not a traceback after a plan), and so that the engine's version — part of the source id — is read
from the environment the engine will run in, never silently from the launcher's own. Package metadata
only: no engine is imported (the launcher may run on a login node).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from mxlaunch.engines.environment import installed_version, interpreter_of, same_env

LAUNCHER_OWN = "the launcher's own Python"


@dataclass(frozen=True)
class EngineRuntime:
    """Where argv[0] resolves, the interpreter behind it, the engine's version there and where it was read."""

    executable: Optional[str]  # argv[0] on PATH (or as given with a slash); None: not found
    python: Optional[str]  # the interpreter that runs the engine; None: cannot be told (a wrapper script)
    version: Optional[str]
    version_from: str  # "package metadata of /venv/bin/python3", or why no version was read
    problem: Optional[str] = None  # why the command cannot start (None: it can)
    fix: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def _activate_hint(display: str) -> str:
    return f"activate the environment that has {display} (source <venv>/bin/activate)"


def _resolve(prog: str, display: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """(executable, problem, fix) for argv[0]."""
    if os.sep in prog:
        if not os.path.exists(prog):
            return None, f"engine command {prog} does not exist", f"check the path, or {_activate_hint(display)}"
        if os.path.isdir(prog) or not os.access(prog, os.X_OK):
            return None, f"engine command {prog} is not executable", f"chmod +x {prog}, or name the engine's Python instead"
        return os.path.abspath(prog), None, None
    found = shutil.which(prog)
    if found:
        return found, None, None
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder or ".", prog)
        if os.path.isfile(candidate):  # on PATH but without the execute bit: which() skips it
            return None, f"engine command {candidate} is not executable", f"chmod +x {candidate}, or {_activate_hint(display)}"
    return None, f"engine command {prog!r} not found on PATH", f"{_activate_hint(display)}, or give its full path"


def locate(argv: Sequence[str], *, display: str, dists: Tuple[str, ...]) -> EngineRuntime:
    """What would run argv: never raises; `problem` says why it cannot start."""
    if not argv:
        return EngineRuntime(None, None, None, "no command", "no engine command given",
                             "put the engine's command after --")
    exe, problem, fix = _resolve(str(argv[0]), display)
    if exe is None:
        return EngineRuntime(None, None, None, "not read: the command cannot start", problem, fix)
    python, problem = interpreter_of(exe)
    if problem:
        return EngineRuntime(exe, None, None, "not read: the command cannot start", problem,
                             f"reinstall {display} there, or {_activate_hint(display)}")
    if python is None:
        version = installed_version(dists)
        return EngineRuntime(exe, None, version, f"{LAUNCHER_OWN} (cannot tell which Python {exe} runs)")
    where = f"package metadata of {python}" + (f" ({LAUNCHER_OWN})" if same_env(python) else "")
    version = installed_version(dists, python)
    if version is None:
        return EngineRuntime(exe, python, None, where, f"{python} has no {display} installed ({' or '.join(dists)})",
                             f"{_activate_hint(display)}, or pip install {dists[0]} into it")
    return EngineRuntime(exe, python, version, where)
