"""SGLang itself is the oracle for where it keeps its JIT caches when no variable is set (kernel cache seeding,
issue 40): `import sglang` (0.5.2x) points Triton, Inductor, the PTX cache, TileLang and FlashInfer into
$SGLANG_CACHE_DIR, and its DeepGEMM cache follows SGLANG_CACHE_DIR. A first serve through mxlaunch seeds its
key's empty folder from those places (kernelcache/seed.default_places), so they must be SGLang's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mxlaunch.engines.registry import ENGINES
from mxlaunch.kernelcache.seed import default_places
from tests.helpers.sglang_server import REPO, SGLANG_ENV, sglang_python

pytestmark = pytest.mark.live_setup  # SGLang's venv / the CRIU kit (tests/helpers/live_setup.py)

VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "TILELANG_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE")
ORACLE = r"""
import json, os
import sglang  # its import sets the third-party cache variables it does not find set
from sglang.srt.environ import envs
out = {v: os.environ.get(v) for v in json.loads(os.environ["MX_VARS"])}
out["SGLANG_CACHE_DIR"] = os.path.expanduser(envs.SGLANG_CACHE_DIR.get())
out["SGLANG_DG_CACHE_DIR"] = envs.SGLANG_DG_CACHE_DIR.get()
print(json.dumps(out))
"""


@pytest.mark.parametrize("cache_dir", [None, "custom-root"])
def test_seeding_looks_where_sglang_keeps_its_caches(tmp_path: Path, cache_dir: str | None) -> None:
    python = sglang_python()
    if not python.exists():
        pytest.fail(f"needs SGLang's venv at {python} — run `make sglang-venv`")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (*VARS, "SGLANG_CACHE_DIR", "SGLANG_DG_CACHE_DIR",
                                                            "XDG_CACHE_HOME")}
    env.update(SGLANG_ENV, HOME=str(home), MX_VARS=json.dumps(VARS))
    if cache_dir:
        env["SGLANG_CACHE_DIR"] = str(tmp_path / cache_dir)
    proc = subprocess.run([str(python), "-c", ORACLE], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sglang = json.loads(proc.stdout.strip().splitlines()[-1])

    ours = default_places({"HOME": str(home), **({"SGLANG_CACHE_DIR": env["SGLANG_CACHE_DIR"]} if cache_dir else {})},
                          redirect=ENGINES["sglang"].kernel_cache_redirect)
    for var in (*VARS, "SGLANG_DG_CACHE_DIR"):
        place = ours[var][0]  # the newest: this SGLang's
        where = Path(sglang[var]) / place.inside if place.inside else Path(sglang[var])
        assert place.folder == where, (var, place.folder, where)
    assert ours["SGLANG_CACHE_DIR"][0].folder == Path(sglang["SGLANG_CACHE_DIR"])
