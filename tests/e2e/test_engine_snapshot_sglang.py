"""`launch --engine-snapshot` on real SGLang 0.5.23 (CPU) with a real CRIU (4.2.1, scripts/kits/build_criu_kit.sh):
the first start (a capture) serves and is snapshotted with its whole tree — the API server, the resource tracker,
`sglang::scheduler_TP0` and `sglang::detokenizer`, the latter without mxlaunch's handler (SGLang loads no plugin
there) — and serves on; the next start of the same command restores it instead of starting SGLang, answers
exactly as the snapshotted engine did, and stops like a spawned one.

The GPU half (the CUDA driver's checkpoint of the scheduler, the context-less cuInit of the other processes) is
the H200 run of docs/sglang-gpu.md. Where CRIU cannot run (not root, no kit) the test is skipped with the reason;
as root it must run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mxlaunch.fileutil import pid_alive
from mxlaunch.warmstart.engine_tree import process_title
from tests.e2e.test_zygote_image import usable_criu
from tests.helpers.cli import compare_gold, run_cli
from tests.helpers.launcher import LaunchProcess
from tests.helpers.sglang_server import sglang_python
from tests.helpers.vllm_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.live_setup]  # tests/helpers/live_setup.py
READY_S = 500


@pytest.mark.full  # the engine snapshot runs live on vLLM in the default run (test_engine_snapshot_vllm.py)
def test_a_serving_sglang_is_snapshotted_whole_and_the_next_start_restores_it_exactly(tiny_model: Path,
                                                                                      tmp_path: Path) -> None:
    if not sglang_python().exists():
        pytest.fail(f"SGLang tests need SGLang's venv at {sglang_python()} — run `make sglang-venv` (make test does)")
    usable_criu()
    store, gold = tmp_path / "store", tmp_path / "gold.json"
    env = {"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps")}
    port = free_port()  # the same command both times: the snapshot listens on its port
    first = LaunchProcess(tiny_model, store, port=port, engine="sglang", launch_args=("--engine-snapshot",), env=env)
    try:
        assert first.wait_event("plan", 120)["strategy"] == "capture"
        first.wait_event("ready", READY_S)
        taken = first.wait_event("engine-snapshot", 300)
        assert taken["status"] == "published" and taken["gpu_pids"] == 0, taken
        meta = json.loads((Path(taken["path"]) / "meta.json").read_text())
        titles = [process_title(pid) for pid in meta["pids"]]  # the dumped processes, still serving
        # its answers after the pause are the gold (the capture start's own are checked against SGLang's default
        # loader in test_launch_sglang.py)
        recorded = run_cli("verify", "--url", first.url, "--record", str(gold), "--wait", "60", "--json")
        assert recorded.returncode == 0, recorded.stderr
    finally:
        first.stop()
    assert meta["root"] == meta["pids"][0] and len(meta["pids"]) == 4, titles
    assert [t for t in titles if t.startswith("sglang::scheduler")] and "sglang::detokenizer" in titles, titles
    assert not [pid for pid in meta["pids"] if pid_alive(pid)]  # the first engine is gone

    second = LaunchProcess(tiny_model, store, port=port, engine="sglang", launch_args=("--engine-snapshot",), env=env)
    try:
        restored = second.wait_event("engine-snapshot", 120)
        assert restored["status"] == "restored" and restored["path"] == taken["path"], restored
        assert second.wait_event("plan", 30)["strategy"] == "snapshot"
        assert second.wait_event("ready", 120)["strategy"] == "snapshot"
        assert set(meta["pids"]) <= {p.pid for p in second.engine_processes()}  # the launcher adopted the whole tree
        assert compare_gold(second.url, gold)["pass"] is True
    finally:
        code = second.stop()
    assert code == second.wait_event("exit", 5)["code"], code
    assert not [pid for pid in meta["pids"] if pid_alive(pid)]  # stopped like a spawned engine
    put_back = [*meta["shm_files"], *(f"/dev/shm/{n}" for n in meta["link_remaps"])]
    assert not [p for p in put_back if os.path.exists(p)]  # what the restore put back goes with the run
