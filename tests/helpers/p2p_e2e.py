"""The P2P steps the vLLM e2e tests share: wait for a launcher to serve its rank over NIXL, have a second
launcher pull from it exactly, and attack it to see the next one catch the changed bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

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


def pull_exactly(start_target: Callable[[], LaunchProcess], gold_file: Path, registry, plan: dict, live) -> None:
    """A second server (`start_target()`) plans p2p, pulls from `live`, serves the gold exactly and becomes
    a source; its stop removes its record."""
    target = start_target()
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


def an_outsiders_write_is_caught(start_target: Callable[[], LaunchProcess], registry_url: str, plan: dict, out: Path,
                                 gold_file: Path) -> tuple[dict, dict]:
    """Issue 29's attack on the live source: an outsider NIXL agent WRITEs over its embedding through its
    record; the next replica (`start_target()`) plans p2p, catches the changed bytes by their checksums and
    serves the default loader's numbers anyway. Returns (what the attack wrote, the fallback event)."""
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.p2p_peer", "attack", "--registry", registry_url,
                           "--source-id", plan["source_id"], "--tensor", "model.embed_tokens.weight", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    attack = json.loads(out.read_text())
    assert attack.get("wrote", 0) > 0, (attack, proc.stderr[-2000:])  # the WRITE lands (NIXL allows it)
    target = start_target()
    try:
        tplan = target.wait_event("plan", 120)
        assert tplan["strategy"] == "p2p", tplan
        fallback = target.wait_event("fallback", READY_S)
        assert "differ from the checksums" in fallback["reason"], fallback
        target.wait_event("ready", READY_S)
        report = compare_gold(target.url, gold_file)  # vLLM's own loader served: still exact
        assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
    finally:
        target.stop()
    return attack, fallback
