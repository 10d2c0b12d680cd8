"""The oracle for the zygote key (issue 42), shared by its vLLM test (tests/unit/test_zygote_key_oracle.py) and its
SGLang test (tests/e2e/test_zygote_key_oracle_sglang.py, which needs the live setup's SGLang venv): import what a
zygote imports, for each engine, in its own interpreter, with os.environ recording every name read; every name read
must be keyed (warmstart/zygote_env.py, by name or prefix) or pinned while the zygote imports (TMPDIR), and the names
that say which job, node or host this is must not be read at all.

A read that copies the whole environment (`dict(os.environ)`, `os.environ.items()`) is not a read of each
name: the sites doing so are listed (BULK_SITES, each reviewed) and a new one fails the test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from mxlaunch.warmstart import zygote_env

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "tests" / "helpers" / "sglang_shim"
# what says which job, node, host this is: a new job changes them all, so no import may read them
JOB_VARS = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_NODELIST": "gpu[01-02]", "SLURMD_NODENAME": "gpu01",
            "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "HOSTNAME": "gpu01.oracle", "SSH_CONNECTION": "1 2 3 4"}
# whole-environment copies at import, reviewed: none keeps a value the engine uses later
BULK_SITES = {
    "platform.py": "platform's `file` subprocess gets a copy with LC_ALL=C, used once and dropped",
    "tqdm/utils.py": "scans for TQDM_* (keyed by prefix)",
    "networkx/utils/backends.py": "scans for NETWORKX_* (keyed by prefix)",
    "wsgiref/handlers.py": "a copy for wsgiref's CGI handlers, which neither engine serves with",
    "subprocess.py": "a subprocess started at import inherits the environment",
    "sglang/srt/environ.py": "scans for SGL_* to rename them SGLANG_* (both keyed by prefix)",
    "fsspec/config.py": "scans for FSSPEC_* (keyed by prefix)",
}

TRACER = r'''
import json, os, sys
READ, BULK = {}, []
SKIP = ("<frozen os>", "<frozen _collections_abc>", "/os.py", "/_collections_abc.py")
def site(depth):
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.endswith(SKIP):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"
class Recording(os._Environ):
    def __getitem__(self, key):
        where = site(2)
        if where not in BULK:  # a value read by a whole-environment copy is part of that copy, not a read
            READ.setdefault(key if isinstance(key, str) else key.decode(), where)
        return super().__getitem__(key)
    def __iter__(self):
        BULK.append(site(2))
        return super().__iter__()
os.environ.__class__ = Recording
import importlib
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)[:300]
print("ORACLE" + json.dumps({"read": READ, "bulk": BULK, "failed": failed}))
'''


def trace(python: Path, modules: list[str], extra_env: dict[str, str]) -> dict:
    env = {**os.environ, **JOB_VARS, **extra_env, "TMPDIR": "/tmp"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_env.get("PYTHONPATH"), str(REPO)) if p)
    out = subprocess.run([str(python), "-c", TRACER, *modules], env=env, cwd=str(REPO), capture_output=True,
                         text=True, timeout=300)
    line = next((x for x in out.stdout.splitlines() if x.startswith("ORACLE")), None)
    assert line, out.stderr[-3000:]
    return json.loads(line[len("ORACLE"):])


def check(found: dict) -> None:
    assert not found["failed"], found["failed"]  # a module the zygote imports did not import here
    allowed = {*zygote_env.PINNED, *zygote_env.STALE_OK}
    unkeyed = {k: v for k, v in found["read"].items() if not zygote_env.keyed(k) and k not in allowed}
    assert not unkeyed, f"read at import but not in the zygote key (warmstart/zygote_env.py): {unkeyed}"
    job = {k: v for k, v in found["read"].items() if k in JOB_VARS and k not in zygote_env.STALE_OK}
    assert not job, f"the imports read which job/host this is: {job}"
    unknown = [s for s in found["bulk"] if not any(s.rsplit(":", 1)[0].endswith("/" + b) for b in BULK_SITES)]
    assert not unknown, f"a new whole-environment copy at import (review it, then list it in BULK_SITES): {unknown}"
