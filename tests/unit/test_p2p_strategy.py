"""The p2p strategy as the engine adapters run it (load_step.build_and_load + RankLoad), with real NIXL
sources in other processes: raw and processed layouts, serving after loading, and the fallback rules —
a failure before any byte lands falls back in place, a failure after bytes landed rebuilds the model and
loads it with the default loader (never the partial one), and markers tell the launcher."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mxlaunch.coord.peers import open_registry
from mxlaunch.plan import Plan
from mxlaunch.plugin.load_step import build_and_load, effective_plan
from mxlaunch.plugin.rank_load import RankLoad
from mxlaunch.transfer import nixl as nixl_transfer
from tests.helpers.p2p_models import build, checkpoint
from tests.helpers.p2p_peer import SOURCE_ID
from tests.unit.test_p2p_nixl import equal_to_seed0, sources  # noqa: F401 - the fixture

pytestmark = pytest.mark.unit
log = logging.getLogger("test")


class Engine:
    """What an engine adapter does around build_and_load: build a model with placeholder values, run the
    weight step (RankLoad with the plan, or the 'checkpoint' of seed 0 as the default loader), post-process."""

    def __init__(self, plan: Plan, layout: str, size: str = "tiny") -> None:
        self.plan, self.layout, self.size = plan, layout, size
        self._outcome = self._rank_load = None
        self._force_default = False
        self.builds = 0

    def build(self):
        self.builds += 1
        model = build(100 + self.builds, self.size, post=False)

        def default_load() -> None:
            model.load_state_dict(checkpoint(0, self.size))

        self._rank_load = RankLoad(model, effective_plan(self, self.plan), 0, default_load, engine="Test", log=log)
        self._outcome = self._rank_load.run()
        model.post_process()
        return model

    def load(self):
        return build_and_load(self, self.build, plan=self.plan, rank=0, log=log, engine="Test")


def plan_for(tmp: Path, layout: str, serve: bool = True) -> Plan:
    run = tmp / "run"
    run.mkdir(exist_ok=True)
    return Plan(strategy="p2p", source_id=SOURCE_ID, run_dir=str(run), wait_timeout_s=5,
                p2p={"registry": f"file:{tmp / 'reg'}", "layout": layout, "world": 1, "run_id": "target-run",
                     "serve": serve, "timeout_s": 30})


def markers(plan: Plan) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in plan.markers_dir.glob("*.json")}


@pytest.mark.parametrize("layout", ["raw", "processed"])
def test_pull_then_serve(tmp_path, sources, layout: str) -> None:
    sources("--layout", layout)
    plan = plan_for(tmp_path, layout)
    engine = Engine(plan, layout)
    model = engine.load()
    assert equal_to_seed0(model) and engine.builds == 1
    loaded = markers(plan)["loaded-0"]
    assert loaded["strategy"] == "p2p" and loaded["bytes"] > 0 and loaded["source"]
    mine = [e for e in open_registry(plan.p2p["registry"], None).sources(SOURCE_ID, 0) if e.record.run_id == "target-run"]
    assert len(mine) == 1 and mine[0].record.layout == layout
    assert open_registry(plan.p2p["registry"], None).remove_run("target-run") == 1


def test_no_source_falls_back_in_place_for_raw(tmp_path) -> None:
    plan = plan_for(tmp_path, "raw", serve=False)
    engine = Engine(plan, "raw")
    model = engine.load()
    assert equal_to_seed0(model) and engine.builds == 1  # default loader, same model
    assert "no live P2P source" in markers(plan)["fallback-0"]["reason"]


def test_processed_layout_without_a_source_rebuilds_with_the_default_loader(tmp_path) -> None:
    plan = plan_for(tmp_path, "processed", serve=False)
    engine = Engine(plan, "processed")
    model = engine.load()  # post-processing ran on placeholders: only a rebuild is safe
    assert equal_to_seed0(model) and engine.builds == 2
    assert "building the model again" in markers(plan)["fallback-0"]["reason"]


def test_a_source_killed_mid_transfer_rebuilds_and_serves_correct_weights(tmp_path, sources, monkeypatch) -> None:
    source = sources("--layout", "raw", "--size", "big")
    real_pull = nixl_transfer.Agent.pull

    def pull_and_kill(self, metadata, pairs, **kw):
        kw["on_batch"] = lambda i: source.kill() if i == 1 else None
        kw["batch_bytes"] = 16 << 20  # several READ requests (the default posts one)
        return real_pull(self, metadata, pairs, **kw)

    monkeypatch.setattr(nixl_transfer.Agent, "pull", pull_and_kill)
    plan = plan_for(tmp_path, "raw", serve=False)
    engine = Engine(plan, "raw", size="big")
    model = engine.load()
    assert engine.builds == 2 and equal_to_seed0(model, "big")
    reason = markers(plan)["fallback-0"]["reason"]
    assert "after bytes landed" in reason and "building the model again" in reason


def test_a_plan_that_forbids_falling_back_stops(tmp_path) -> None:
    plan = plan_for(tmp_path, "processed", serve=False)
    plan.fallback_ok = False
    with pytest.raises(RuntimeError, match="forbids falling back"):
        Engine(plan, "processed").load()


def test_a_worker_loaded_by_the_default_loader_serves_and_a_target_pulls_it_exactly(tmp_path) -> None:
    """Strategy default with serving on (a capture or staged run is the same from here): the agent starts
    while the model is built, the raw copy is taken before post-processing, the record is published after
    the loaded marker, and another process pulls exact weights from it."""
    import subprocess
    import sys

    from tests.unit.test_p2p_nixl import ROOT

    plan = plan_for(tmp_path, "raw")
    plan.strategy = "default"
    engine = Engine(plan, "raw")
    model = engine.load()
    assert equal_to_seed0(model) and engine.builds == 1
    (mine,) = [e for e in open_registry(plan.p2p["registry"], None).sources(SOURCE_ID, 0) if e.record.run_id == "target-run"]
    out = tmp_path / "pulled.json"
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.p2p_peer", "pull", "--registry", str(tmp_path / "reg"),
                           "--layout", "raw", "--seed", "9", "--out", str(out)], cwd=ROOT, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    pulled = json.loads(out.read_text())
    assert pulled["equal"] is True and pulled["source"] == mine.record.worker
    assert open_registry(plan.p2p["registry"], None).remove_run("target-run") == 1
