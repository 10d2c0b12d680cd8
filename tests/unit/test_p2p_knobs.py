"""The NIXL knobs (settings.nixl_*): parsing good and bad input, and pulls through them between real
processes with real NIXL on the CPU — prepared descriptor lists, the UCX backend's thread pool, no
progress thread — exact, with `landed` kept as the plain path has it."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch import settings
from mxlaunch.errors import EXIT_USAGE, UsageError
from mxlaunch.plugin.tensors import RestoreError
from mxlaunch.transfer import nixl_batches
from mxlaunch.transfer.nixl import Agent, NixlUnavailable, TransferError
from mxlaunch.transfer.nixl_batches import PullConfig
from mxlaunch.transfer.tensor_set import Pair
from tests.unit import test_p2p_nixl
from tests.unit.test_p2p_nixl import equal_to_seed0

sources = test_p2p_nixl.sources  # the same fixture: real source processes, killed at the end

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
UCX = settings.NIXL_UCX_PARAMS
PULL = settings.NIXL_PULL


# ---- parsing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("", {}),
    ("   ", {}),
    ("num_threads=4,split_batch_size=1", {"num_threads": "4", "split_batch_size": "1"}),
    (" num_workers = 2 , ", {"num_workers": "2"}),
    ("num_workers=2;engine_config=MAX_RMA_RAILS=1,RNDV_THRESH=inf",
     {"num_workers": "2", "engine_config": "MAX_RMA_RAILS=1,RNDV_THRESH=inf"}),
    ("ucx_error_handling_mode=none,device_list=mlx5_0", {"ucx_error_handling_mode": "none", "device_list": "mlx5_0"}),
    ("num_threads=0", {"num_threads": "0"}),
])
def test_ucx_params_good(text, expected) -> None:
    assert settings.nixl_ucx_params({UCX: text}) == expected


def test_ucx_params_unset_is_the_measured_default_and_empty_is_nixls_own() -> None:
    assert settings.nixl_ucx_params({}) == {"num_threads": "4", "split_batch_size": "1"}
    assert settings.nixl_ucx_params({UCX: ""}) == {}


@pytest.mark.parametrize("text, says", [
    ("num_threads", "'num_threads' is not a key=value item"),
    ("=4", "'=4' is not a key=value item"),
    ("num threads=4", "is not a key=value item"),
    ("num_threads=", "num_threads has no value"),
    ("num_threads=2,num_threads=4", "num_threads is given twice"),
    ("num_thread=4", "unknown UCX backend parameter 'num_thread'"),
    ("num_threads=four", "num_threads=four is not a whole number ≥ 0"),
    ("num_workers=0", "num_workers=0 is not a whole number ≥ 1"),
    ("split_batch_size=-1", "split_batch_size=-1 is not a whole number ≥ 1"),
    ("ucx_error_handling_mode=strict", "ucx_error_handling_mode=strict"),
])
def test_ucx_params_bad_is_one_usage_line(text, says) -> None:
    with pytest.raises(UsageError) as info:
        settings.nixl_ucx_params({UCX: text})
    line = info.value.one_line()
    assert says in line and line.startswith(UCX) and "\n" not in line and info.value.fix
    assert info.value.exit_code == EXIT_USAGE


@pytest.mark.parametrize("text, expected", [
    ("", {}),
    ("prepped=1", {"prepped": True}),
    ("prepped=0,merge=0,chunk_mib=64,inflight=2,batch_mib=0",
     {"prepped": False, "merge": False, "chunk_mib": 64, "inflight": 2, "batch_mib": 0}),
])
def test_pull_settings_good(text, expected) -> None:
    assert settings.nixl_pull({PULL: text}) == expected


@pytest.mark.parametrize("text, says", [
    ("prepped=yes", "prepped=yes"),
    ("inflight=0", "inflight=0 is not a whole number ≥ 1"),
    ("chunk=64", "unknown key 'chunk'"),
    ("prepped", "is not a key=value item"),
])
def test_pull_settings_bad(text, says) -> None:
    with pytest.raises(UsageError, match=says):
        settings.nixl_pull({PULL: text})


def test_pull_config_from_env_and_progress_thread() -> None:
    assert PullConfig.from_env({PULL: "prepped=1,merge=0,batch_mib=0"}) == PullConfig(prepped=True, merge=False,
                                                                                       batch_mib=0)
    assert PullConfig.from_env({}) == PullConfig(chunk_mib=64, batch_mib=0)  # the measured default
    assert PullConfig.from_env({PULL: ""}) == PullConfig()
    assert settings.nixl_progress_thread({}) is True
    assert settings.nixl_progress_thread({settings.NIXL_PROGRESS_THREAD: "0"}) is False
    assert settings.nixl_progress_thread({settings.NIXL_PROGRESS_THREAD: "1"}) is True


def test_a_malformed_setting_stops_the_launch_and_refuses_the_agent(monkeypatch, tmp_path) -> None:
    from mxlaunch.launch.p2p import decide_p2p

    monkeypatch.setenv(UCX, "num_threads")
    with pytest.raises(UsageError, match="is not a key=value item"):
        decide_p2p(enabled=True, registry_url=f"file:{tmp_path}", store_root=tmp_path, source_id="x" * 16,
                   device_type="cpu", world=1, snapshot_ranks=[0], argv=["python"])
    with pytest.raises(NixlUnavailable, match=f"{UCX}: 'num_threads' is not a key=value item"):
        Agent("bad-params")  # p2p.pull turns this into RestoreError(landed=False): the default loader runs
    monkeypatch.delenv(UCX)
    monkeypatch.setenv(PULL, "inflight=x")
    with pytest.raises(UsageError):
        decide_p2p(enabled=True, registry_url=f"file:{tmp_path}", store_root=tmp_path, source_id="x" * 16,
                   device_type="cpu", world=1, snapshot_ranks=[0], argv=["python"])


def _pair(i: int, n: int, kind: str = "cpu") -> Pair:
    return Pair(f"t{i}", 1000 * i, 5000 * i, n, 0, 0, kind, kind)


def test_ranges_keep_limits_and_kinds(monkeypatch) -> None:
    monkeypatch.setattr(nixl_batches, "BATCH_DESCS", 3)
    pairs = [_pair(i, 10) for i in range(7)] + [_pair(9, 10, "cuda")]
    batches = list(nixl_batches.batches(pairs, 25))
    assert [[p.name for p in b] for b in batches] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6"], ["t9"]]
    assert [len(b) for b in nixl_batches.batches(pairs, 1000)] == [3, 3, 1, 1]  # BATCH_DESCS, then the kind
    assert [len(b) for b in nixl_batches.batches([_pair(0, 100), _pair(1, 5)], 10)] == [1, 1]  # an oversize span alone


# ---- real NIXL between processes (CPU, UCX shared memory) -----------------------------------------------


def pull_in_child(tmp_path: Path, env: dict[str, str], name: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.p2p_peer", "pull", "--registry", str(tmp_path / "reg"),
                           "--size", "big", "--seed", "5", "--out", str(out)], cwd=ROOT, env={**os.environ, **env},
                          stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(out.read_text())


# One knob set in the default run; the others (40-110 s each on 2 cores: 1 MiB pieces through UCX) in make test-full.
FULL = pytest.mark.full


@pytest.mark.parametrize("env", [
    {PULL: "prepped=1"},                                           # NIXL merges back-to-back equal pieces
    pytest.param({PULL: "prepped=1,merge=0,chunk_mib=1,inflight=3"}, marks=FULL),  # every 1 MiB piece its own copy
    pytest.param({UCX: "num_threads=2,split_batch_size=1", PULL: "chunk_mib=1,batch_mib=0"}, marks=FULL),  # 2 threads
    pytest.param({UCX: "num_workers=2", settings.NIXL_PROGRESS_THREAD: "0"}, marks=FULL),
], ids=["prepped", "prepped-nomerge-chunks", "ucx-threads", "no-progress-thread"])
def test_a_pull_through_the_knobs_is_exact(tmp_path, sources, env) -> None:
    sources("--layout", "processed", "--size", "big")
    data = pull_in_child(tmp_path, env, "t")
    assert data["equal"] is True and data["bytes"] > 50 << 20
    assert data["ucx_params"] == settings.nixl_ucx_params(env)
    assert data["prepped"] == settings.nixl_pull(env).get("prepped", False)
    assert data["progress_thread"] == settings.nixl_progress_thread(env)


def _target(tmp_path: Path, size: str = "big"):
    from mxlaunch.coord.peers import open_registry
    from mxlaunch.transfer.regions import regions_for
    from mxlaunch.transfer.tensor_set import match, processed_tensors
    from tests.helpers.p2p_models import build
    from tests.helpers.p2p_peer import SOURCE_ID

    model = build(7, size)
    named = processed_tensors(model)
    rec = open_registry(f"file:{tmp_path / 'reg'}", None).sources(SOURCE_ID, 0)[0].record
    agent = Agent(f"knobs-{os.getpid()}", ucx_params={}, pull_config=PullConfig(prepped=True, merge=False))
    agent.register(regions_for([t for _, t in named]))
    return model, agent, match(named, rec.tensors), base64.b64decode(rec.agent_metadata)  # the model: kept alive


def test_prepped_a_source_killed_mid_transfer_is_landed(tmp_path, sources, monkeypatch) -> None:
    source = sources("--layout", "processed", "--size", "big")
    monkeypatch.setattr(nixl_batches, "BATCH_BYTES", 16 << 20)  # several requests from one prepared list
    _model, agent, pairs, meta = _target(tmp_path)
    try:
        def kill_after_first(i: int) -> None:
            if i == 1:
                source.kill()

        with pytest.raises(TransferError) as info:
            agent.pull(meta, pairs, timeout_s=30, on_batch=kill_after_first)
        assert isinstance(info.value, RestoreError) and info.value.landed is True
    finally:
        agent.close()


def test_prepped_a_refused_list_wrote_nothing(tmp_path, sources) -> None:
    sources("--layout", "processed", "--size", "big")
    model, agent, pairs, meta = _target(tmp_path)
    try:
        stats = agent.pull(meta, pairs)  # the good list first: it pulls, exactly
        assert stats.prepped and stats.bytes == sum(p.bytes for p in pairs)
        assert equal_to_seed0(model, "big")
        bad = pairs[:-1] + [Pair("x", pairs[-1].local_addr, pairs[-1].remote_addr + (1 << 40), pairs[-1].bytes,
                                 pairs[-1].local_dev, pairs[-1].remote_dev, pairs[-1].local_kind, pairs[-1].remote_kind)]
        calls = []
        with pytest.raises(TransferError, match="refused to prepare") as info:
            agent.pull(meta, bad, on_batch=calls.append)
        assert info.value.landed is False and calls == []  # refused before the first request was posted
    finally:
        agent.close()
