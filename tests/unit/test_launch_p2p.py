"""launch's P2P decisions on real inputs: a checkpoint folder, a real store, a real file registry with a
live record (this test process publishes it) — p2p when every local rank has a compatible live source,
the reason otherwise; --no-p2p; the plan file's p2p block; records of the run removed at its end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxlaunch.coord.peers import local_record, open_registry
from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch.p2p import unpublish_run
from mxlaunch.plan import load_plan
from mxlaunch.store.core import Store
from tests.helpers.cli import run_cli
from tests.unit.test_launch_plan import serve, write_checkpoint

pytestmark = pytest.mark.unit
ENTRY = {"name": "w", "dtype": "F32", "shape": [4, 4], "bytes": 64, "addr": 4096, "dev": 0}


def publish(store: Path, sid: str, rank: int, *, world: int = 1, layout: str = "raw", run_id: str = "other-run"):
    record = local_record(sid, rank, world, layout=layout, worker=f"w{rank}-{layout}-{world}", run_id=run_id,
                          device="cpu", agent_metadata=b"meta", tensors=[ENTRY])
    return open_registry(None, store).publish(record, ttl_s=60)


def test_a_live_compatible_source_makes_the_launch_pull(tmp_path: Path) -> None:
    model, store = write_checkpoint(tmp_path / "model"), tmp_path / "store"
    opts = LaunchOptions(artifact_path=store)
    first = make_plan(serve(model), opts, Store(store))
    assert first.strategy == "capture" and first.p2p is not None and first.p2p.serve
    assert "no live P2P source of rank 0" in first.p2p.why_not
    pub = publish(store, first.source_id, 0)
    try:
        plan = make_plan(serve(model), opts, Store(store))
        assert plan.strategy == "p2p" and "1 live P2P source(s)" in plan.reason
        assert "--load-format" in plan.argv and plan.p2p.sources[0][0]["worker"] == pub.record.worker
        assert plan.to_json()["p2p"]["can_pull"] is True
        off = make_plan(serve(model), LaunchOptions(artifact_path=store, p2p=False), Store(store))
        assert off.strategy == "capture" and off.p2p is None
    finally:
        pub.unpublish()


@pytest.mark.parametrize("kw, why", [
    ({"layout": "processed"}, "no live P2P source of rank 0 (raw layout, 1 ranks)"),
    ({"world": 2}, "no live P2P source of rank 0 (raw layout, 1 ranks)"),
])
def test_an_incompatible_source_is_not_offered(tmp_path: Path, kw: dict, why: str) -> None:
    model, store = write_checkpoint(tmp_path / "model"), tmp_path / "store"
    sid = make_plan(serve(model), LaunchOptions(artifact_path=store)).source_id
    pub = publish(store, sid, 0, **kw)
    try:
        plan = make_plan(serve(model), LaunchOptions(artifact_path=store))
        assert plan.strategy == "capture" and why in plan.p2p.why_not
    finally:
        pub.unpublish()


def test_tp2_needs_a_source_for_every_local_rank(tmp_path: Path) -> None:
    model, store = write_checkpoint(tmp_path / "model"), tmp_path / "store"
    sid = make_plan(serve(model, "-tp", "2"), LaunchOptions(artifact_path=store)).source_id
    pubs = [publish(store, sid, 0, world=2)]
    try:
        half = make_plan(serve(model, "-tp", "2"), LaunchOptions(artifact_path=store))
        assert half.strategy == "capture" and "rank 1" in half.p2p.why_not
        pubs.append(publish(store, sid, 1, world=2))
        assert make_plan(serve(model, "-tp", "2"), LaunchOptions(artifact_path=store)).strategy == "p2p"
    finally:
        for p in pubs:
            p.unpublish()


def test_strategy_p2p_without_a_source_serves_default_with_the_reason(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    plan = make_plan(serve(model), LaunchOptions(artifact_path=tmp_path / "store", strategy="p2p"))
    assert plan.strategy == "default" and "no live P2P source" in plan.reason


def test_the_dry_run_says_where_p2p_stands(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    text = run_cli("launch", "--dry-run", "--artifact-path", str(tmp_path / "store"), "--", *serve(model))
    assert text.returncode == 0, text.stderr
    said = " ".join(text.stdout.split())  # rich wraps long lines
    assert "p2p raw layout via file:" in said and "workers serve after loading" in said
    data = json.loads(run_cli("launch", "--dry-run", "--json", "--no-p2p", "--artifact-path", str(tmp_path / "store"),
                              "--", *serve(model)).stdout)
    assert data["p2p"] is None


def test_the_plan_file_carries_the_p2p_block_and_the_run_unpublishes(tmp_path: Path) -> None:
    from mxlaunch.launch.run import Launcher

    model, store = write_checkpoint(tmp_path / "model"), tmp_path / "store"
    opts = LaunchOptions(artifact_path=store)
    plan = make_plan(serve(model), opts, Store(store))
    launcher = Launcher(plan, opts, emit=lambda *a, **k: None, echo=lambda s: None, store=Store(store))
    try:
        written = launcher._prepare()
        block = load_plan(launcher.shm_dir / "plan.json").p2p
        assert block == written.p2p and block["run_id"] == launcher.run_id and block["layout"] == "raw"
        assert block["registry"].startswith("file:") and block["serve"] is True
        pub = publish(store, plan.source_id, 0, run_id=launcher.run_id)
        assert unpublish_run(plan.p2p, launcher.run_id, store) == 1
        assert pub.heartbeat() is False and open_registry(None, store).sources(plan.source_id, 0) == []
    finally:
        if launcher.capture is not None:
            launcher.capture.close()
        import shutil

        shutil.rmtree(launcher.shm_dir, ignore_errors=True)
