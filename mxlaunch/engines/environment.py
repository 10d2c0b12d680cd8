"""What an engine command needs from the machine, whatever the engine: its interpreter, its installed
version and the model's local folder. Never imports an engine (the launcher may run on a login node)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

PYTHON_EXE = re.compile(r"^python(\d+(\.\d+)?)?$")
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


# ---- hub cache --------------------------------------------------------------------------------------


def hub_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(var):
            return Path(environ[var]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def model_config(model_path: Optional[str]) -> Dict:
    """The model folder's config.json as a dict ({} when there is none or it is not a JSON object): what the
    engines' plan-time checks read (architecture, quantization, MoE keys)."""
    if not model_path:
        return {}
    try:
        data = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_hub_id(model: str) -> bool:
    """org/name (or name): not a path. A hub id names a repo; a path never parses as one."""
    return bool(_REPO_ID.match(model)) and not model.startswith((".", "/", "~")) and not Path(model).expanduser().exists()


def resolve_model_path(model: str, revision: Optional[str] = None) -> Tuple[Optional[str], Optional[str]]:
    """(local directory, None) for a model directory or a hub id found in the local hub cache;
    (None, reason) otherwise. Never touches the network."""
    p = Path(model).expanduser()
    if p.is_dir():
        return str(p.resolve()), None
    if p.is_file():
        return None, f"model {model} is a single file (GGUF?): mxlaunch snapshots need a model directory"
    if model.startswith("s3://"):
        return None, (f"model {model} is in S3; `mxlaunch launch` downloads it once per artifact store before it plans "
                      f"(or run `mxlaunch pull {model}`)")
    if not _REPO_ID.match(model) or model.startswith((".", "/", "~")):
        return None, f"model {model} is neither a local directory nor a hub id"
    repo = hub_cache_dir() / ("models--" + model.replace("/", "--"))
    rev = revision or "main"
    commit = None
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif re.fullmatch(r"[0-9a-f]{40}", rev):
        commit = rev
    snap = repo / "snapshots" / commit if commit else None
    if snap is None or not snap.is_dir():
        where = f"revision {revision}" if revision else "refs/main"
        return None, (f"model {model} is not in the local hub cache ({repo}, {where}); `mxlaunch launch` downloads it once "
                      f"per artifact store before it plans (or run `mxlaunch pull {model}`)")
    return str(snap.resolve()), None


# ---- interpreter and version --------------------------------------------------------------------------


def same_env(python: str) -> bool:
    """Is `python` the launcher's own interpreter (same bin folder)?"""
    exe = shutil.which(python) or python
    return os.path.dirname(os.path.abspath(exe)) == os.path.dirname(os.path.abspath(sys.executable))


def interpreter_of(exe: str) -> Tuple[Optional[str], Optional[str]]:
    """(python, problem) behind an executable: itself for a Python, its shebang's for a console script
    (`#!/venv/bin/python3` or `#!/usr/bin/env python3`); (None, None) when it cannot be told (a binary, a shell
    wrapper); a problem when the shebang names an interpreter that does not exist."""
    if PYTHON_EXE.match(os.path.basename(exe)):
        return exe, None
    try:
        with open(exe, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None, None
    if not first.startswith(b"#!"):
        return None, None
    parts = first[2:].decode(errors="replace").split()
    if len(parts) >= 2 and os.path.basename(parts[0]) == "env":
        found = shutil.which(parts[1]) if PYTHON_EXE.match(parts[1]) else None
        return found, None
    if parts and PYTHON_EXE.match(os.path.basename(parts[0])):
        if not os.path.exists(parts[0]):
            return None, f"{exe} runs {parts[0]}, which does not exist (a moved or removed environment?)"
        return parts[0], None
    return None, None


def engine_python(argv: List[str]) -> Optional[str]:
    """The interpreter that will run the engine: argv[0] for the `python -m` forms, the console
    script's shebang for `vllm serve` / `sglang serve`; None when it cannot be told (then the
    launcher's own is assumed)."""
    exe = shutil.which(argv[0]) if argv else None
    return interpreter_of(exe)[0] if exe else None


def installed_version(dists: Iterable[str], python: Optional[str] = None) -> Optional[str]:
    """The version of the first installed distribution of `dists`, from package metadata only.

    `python`: the engine's interpreter when it is not the launcher's own (asked in a subprocess).
    None when none is installed there (a login node)."""
    dists = tuple(dists)
    if python is None or same_env(python):
        for dist in dists:
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None
    return installed_versions({"wanted": dists}, python)["wanted"]


def installed_versions(dists: Dict[str, Tuple[str, ...]], python: Optional[str] = None) -> Dict[str, Optional[str]]:
    """name → the version of the first installed distribution of its tuple (None: none installed), plus
    "python" (the interpreter's X.Y.Z), from package metadata only — in one subprocess when `python` is
    not the launcher's own. Every value None when the interpreter cannot be asked."""
    if python is None or same_env(python):
        found = {name: installed_version(group) for name, group in dists.items()}
        return {**found, "python": platform.python_version()}
    code = (
        "import importlib.metadata as m, json, platform, sys\n"
        "def v(g):\n"
        "    for d in g:\n"
        "        try:\n            return m.version(d)\n"
        "        except m.PackageNotFoundError:\n            pass\n"
        f"out = {{k: v(g) for k, g in {dict(dists)!r}.items()}}\n"
        "out['python'] = platform.python_version()\n"
        "print(json.dumps(out))\n"
    )
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
        data = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        data = {}
    return {name: data.get(name) for name in (*dists, "python")}
