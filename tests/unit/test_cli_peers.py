"""`mxlaunch peers` as a user runs it: a fresh interpreter reading the registry this test publishes into."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mxlaunch.coord.peers import local_record, redact_url
from mxlaunch.coord.peers_file import FileRegistry
from tests.helpers.cli import one_line_error, run_cli

SID, SID2 = "0123456789abcdef", "fedcba9876543210"


def record(sid: str, rank: int, worker: str, n: int = 2):
    tensors = [{"name": f"t{i}", "dtype": "float16", "shape": [512], "bytes": 1024, "addr": 1 << 20, "dev": 0}
               for i in range(n)]
    return local_record(sid, rank, 2, layout="raw", worker=worker, run_id="run-cli", device="cpu",
                        agent_metadata=b"md", tensors=tensors)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store with one live source (this process) and one whose heartbeat ran out (it stays stale)."""
    reg = FileRegistry(tmp_path)
    reg.publish(record(SID, 0, "live-w", n=3), ttl_s=600)  # not unpublished: the test's tmp folder goes away
    reg.publish(record(SID2, 1, "stale-w"), ttl_s=0.1)
    time.sleep(0.3)
    return tmp_path


def test_peers_json_lists_live_and_stale(store: Path) -> None:
    result = run_cli("peers", "--artifact-path", str(store), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == 1 and doc["registry"] == f"file:{store}" and "reaped" not in doc
    by_worker = {s["worker"]: s for s in doc["sources"]}
    assert [s["worker"] for s in doc["sources"]] == ["live-w", "stale-w"]  # live first
    live, stale = by_worker["live-w"], by_worker["stale-w"]
    assert (live["state"], live["source_id"], live["rank"], live["world"], live["tensors"], live["bytes"]) == \
           ("live", SID, 0, 2, 3, 3072)
    assert live["pid"] == os.getpid() and live["layout"] == "raw" and live["device"] == "cpu"
    assert stale["state"] == "stale" and stale["reason"] == "heartbeat older than its ttl" and stale["age_s"] >= 0.1


def test_peers_table_and_filter(store: Path) -> None:
    narrow = {**os.environ, "COLUMNS": "80"}
    result = run_cli("peers", "--artifact-path", str(store), "--source-id", SID, env=narrow)
    assert result.returncode == 0, result.stderr
    assert "live-w" in result.stdout and "stale-w" not in result.stdout and "1/2" not in result.stdout
    for word in (f"source {SID}", "1 live, 0 stale", "0/2", "raw", "cpu", f" {os.getpid()} ", "live", "3.00 KiB"):
        assert word in result.stdout, (word, result.stdout)
    result = run_cli("peers", "--artifact-path", str(store), env=narrow)
    assert result.stdout.index(SID) < result.stdout.index(SID2)  # one table per source id, in id order
    assert "0 live, 1 stale" in result.stdout and all(len(line) <= 80 for line in result.stdout.splitlines())


def test_peers_reap(store: Path) -> None:
    result = run_cli("peers", "--artifact-path", str(store), "--reap")
    assert result.returncode == 0, result.stderr
    assert "reaped 1 stale record" in result.stdout and "stale-w" not in result.stdout
    doc = json.loads(run_cli("peers", "--artifact-path", str(store), "--reap", "--json").stdout)
    assert doc["reaped"] == 0 and [s["worker"] for s in doc["sources"]] == ["live-w"]


def test_peers_empty_and_registry_from_the_environment(tmp_path: Path) -> None:
    env = {**os.environ, "MXLAUNCH_REGISTRY": f"file:{tmp_path}/other"}
    FileRegistry(tmp_path / "other").publish(record(SID, 1, "env-w"), ttl_s=600)
    result = run_cli("peers", "--artifact-path", str(tmp_path), "--json", env=env)
    assert [s["worker"] for s in json.loads(result.stdout)["sources"]] == ["env-w"]
    result = run_cli("peers", "--registry", "file", "--artifact-path", str(tmp_path), env=env)  # the flag wins
    assert result.returncode == 0 and "no sources in" in result.stdout


@pytest.mark.parametrize("args, words", [
    (["--registry", "ftp://x"], "unknown registry URL"),
    (["--registry", "redis://:pw@127.0.0.1:1/0"], "cannot reach the peer registry at redis://:***@127.0.0.1:1/0"),
    (["--source-id", "../etc"], "is not a valid source id"),
])
def test_peers_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], words: str) -> None:
    result = run_cli("peers", "--artifact-path", str(tmp_path), *args)
    assert result.returncode == 2
    line = one_line_error(result)
    assert words in line and "—" in line and "pw" not in line


@pytest.mark.redis
def test_peers_redis(redis_url: str, tmp_path: Path) -> None:
    import redis

    from mxlaunch.coord.peers_redis import RedisRegistry

    redis.Redis.from_url(redis_url).flushdb()
    pub = RedisRegistry(redis_url).publish(record(SID, 0, "redis-w"), ttl_s=600)
    doc = json.loads(run_cli("peers", "--registry", redis_url, "--json").stdout)
    assert doc["registry"] == redact_url(redis_url) and [(s["worker"], s["state"]) for s in doc["sources"]] == [("redis-w", "live")]
    pub.unpublish()
    assert json.loads(run_cli("peers", "--registry", redis_url, "--json").stdout)["sources"] == []
