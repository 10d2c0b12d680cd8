"""The P2P source registry, the same tests against both backends: the shared filesystem and a real Redis.

Staleness is tested with real processes (a publisher killed with SIGKILL) and real clocks (short ttls);
corrupt records are written the way a broken or hostile writer would leave them, straight to the files
or to the Redis server.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from mxlaunch.coord.peers import (
    MAX_RECORD_BYTES, PeerRegistry, Publication, SourceRecord, local_record, open_registry, redact_url)
from mxlaunch.coord.peers_file import FileRegistry
from mxlaunch.coord.peers_record import Beat, judge
from mxlaunch.errors import CheckFailed, UsageError

REPO = Path(__file__).resolve().parents[2]
SID, SID2 = "0123456789abcdef", "fedcba9876543210"

# A publisher in its own process: publish one record (ttl from argv), say so, hold it until stdin closes.
PUBLISHER = r"""
import sys
from mxlaunch.coord.peers import local_record, open_registry
url, sid, worker, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
tensors = [{"name": "w", "dtype": "float32", "shape": [2], "bytes": 8, "addr": 4096, "dev": 0}]
record = local_record(sid, 0, 1, layout="raw", worker=worker, run_id="run-child", device="cpu",
                      agent_metadata=b"md", tensors=tensors)
publication = open_registry(url, None).publish(record, ttl_s=ttl)
print("published", flush=True)
sys.stdin.read()
publication.unpublish()
"""


@dataclass
class Backend:
    name: str
    url: str
    root: Path  # the file backend's store root (unused by redis)

    def open(self, host: str | None = None) -> PeerRegistry:
        if self.name == "file":
            return FileRegistry(self.root, host=host)
        from mxlaunch.coord.peers_redis import RedisRegistry

        return RedisRegistry(self.url, host=host)


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        return Backend("file", f"file:{tmp_path}", tmp_path)
    import redis

    url = request.getfixturevalue("redis_url")
    redis.Redis.from_url(url).flushdb()
    return Backend("redis", url, tmp_path)


def tensors(n: int = 3) -> list[dict]:
    return [{"name": f"layers.{i}.weight", "dtype": "bfloat16", "shape": [4, 8], "bytes": 64,
             "addr": 0x7F0000000000 + 64 * i, "dev": 0} for i in range(n)]


def rec(sid: str = SID, rank: int = 0, worker: str = "w0", run_id: str = "run-a", **kw) -> SourceRecord:
    return local_record(sid, rank, 2, layout="processed", worker=worker, run_id=run_id, device="cuda",
                        agent_metadata=b"\x00nixl-agent-md", tensors=tensors(), **kw)


def workers(entries: list) -> list[str]:
    return [e.record.worker for e in entries]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---- the record ----


def test_record_round_trips_and_counts() -> None:
    r = rec(extra={"tp": 2})
    data = json.loads(json.dumps(r.to_json()))
    assert data["schema"] == 1 and SourceRecord.from_json(data) == r
    assert r.total_bytes == 3 * 64 and r.metadata_bytes() == b"\x00nixl-agent-md"
    assert r.pid == os.getpid() and r.boot_id and r.start_time > 0


@pytest.mark.parametrize("change", [
    {"schema": 2}, {"rank": True}, {"rank": 2}, {"rank": -1}, {"world": 0}, {"layout": "sharded"},
    {"worker": "../w"}, {"worker": ".hidden"}, {"source_id": "a/b"}, {"run_id": ""}, {"device": "tpu"},
    {"agent_metadata": "not base64!"}, {"agent_metadata": ""}, {"pid": 0}, {"start_time": -1},
    {"created_at": float("nan")}, {"extra": None}, {"tensors": "x"}, {"tensors": [{"name": "a"}]},
    {"tensors": [dict(tensors(1)[0], bytes=-1)]}, {"tensors": [dict(tensors(1)[0], shape=[2, "x"])]},
    {"tensors": [dict(tensors(1)[0], addr=1.5)]}, {"tensors": tensors(1) * 2}, {"host": ""},
])
def test_record_validation_refuses(change: dict) -> None:
    data = {**rec().to_json(), **change}
    assert SourceRecord.from_json(data) is None
    assert SourceRecord.from_json({k: v for k, v in rec().to_json().items() if k != "tensors"}) is None


def test_publishing_an_invalid_record_is_refused(backend: Backend) -> None:
    bad = replace(rec(), rank=5)
    with pytest.raises(UsageError, match="not valid"):
        backend.open().publish(bad)
    with pytest.raises(UsageError, match="ttl"):
        backend.open().publish(rec(), ttl_s=0)


# ---- publish, look up, heartbeat ----


def test_publish_and_look_up(backend: Backend) -> None:
    reg = backend.open()
    assert isinstance(reg, PeerRegistry) and reg.url == backend.url
    before = time.time()
    pub = reg.publish(rec(), ttl_s=30)
    assert isinstance(pub, Publication) and pub.record.worker == "w0"
    [entry] = reg.sources(SID, 0)
    assert entry.state == "live" and entry.record == pub.record and entry.ttl_s == 30
    assert entry.heartbeat_at >= before and entry.age_s >= 0  # the first beat is publish's own
    assert reg.sources(SID, 1) == [] and reg.sources(SID2) == []
    assert workers(reg.all_sources()) == ["w0"]
    # another reader (another host) sees the same record
    assert backend.open(host="node-b").sources(SID, 0)[0].record == pub.record
    pub.unpublish()


def test_filters_by_source_and_rank(backend: Backend) -> None:
    reg = backend.open()
    pubs = [reg.publish(rec(rank=0, worker="a")), reg.publish(rec(rank=1, worker="b")),
            reg.publish(rec(sid=SID2, rank=0, worker="c"))]
    assert sorted(workers(reg.sources(SID))) == ["a", "b"]
    assert workers(reg.sources(SID, 1)) == ["b"]
    assert workers(reg.sources(SID2)) == ["c"]
    assert sorted(workers(reg.all_sources())) == ["a", "b", "c"]
    with pytest.raises(UsageError, match="source id|valid key"):
        reg.sources("../etc")
    for p in pubs:
        p.unpublish()
    assert reg.all_sources() == []


def test_two_publishers_of_one_rank_newest_heartbeat_first(backend: Backend) -> None:
    reg = backend.open()
    a = reg.publish(rec(worker="a"))
    time.sleep(0.02)
    b = reg.publish(rec(worker="b"))
    assert workers(reg.sources(SID, 0)) == ["b", "a"]
    time.sleep(0.02)
    assert a.heartbeat()
    assert workers(reg.sources(SID, 0)) == ["a", "b"]
    with pytest.raises(CheckFailed, match="already publishes"):
        reg.publish(rec(worker="a"))  # the same worker id while its record is live
    a.unpublish()
    assert workers(reg.sources(SID, 0)) == ["b"]
    b.unpublish()


def test_stale_by_ttl_then_a_late_heartbeat_refreshes_it(backend: Backend) -> None:
    """Only what holds however loaded the machine is: the sleep is longer than the ttl, so the record is
    stale whatever the scheduler did; a heartbeat after that is taken and moves the beat forward. (Whether
    it is live at the next read depends on how soon that read comes, so that is judge()'s unit test with
    an injected clock, not this one's.)"""
    reg, other = backend.open(), backend.open(host="node-b")  # node-b cannot check our pid: only the ttl tells
    pub = reg.publish(rec(), ttl_s=0.3)
    time.sleep(0.5)
    assert other.sources(SID, 0) == []
    [entry] = other.sources(SID, 0, include_stale=True)
    assert entry.state == "stale" and entry.reason == "heartbeat older than its ttl" and entry.age_s >= 0.3
    assert pub.heartbeat()  # the record is still there: a late heartbeat is taken
    [revived] = other.sources(SID, 0, include_stale=True)
    assert revived.heartbeat_at > entry.heartbeat_at and revived.ttl_s == 0.3
    pub.unpublish()


def test_a_heartbeat_within_the_ttl_keeps_the_record_live(backend: Backend) -> None:
    """A 60 s ttl: every read below comes well inside it, and each beat moves the heartbeat forward."""
    reg, other = backend.open(), backend.open(host="node-b")
    pub = reg.publish(rec(), ttl_s=60.0)
    [before] = other.sources(SID, 0)
    time.sleep(0.05)
    assert pub.heartbeat()
    [after] = other.sources(SID, 0)
    assert after.state == "live" and after.heartbeat_at > before.heartbeat_at
    pub.unpublish()


def test_judge_goes_by_the_heartbeats_age_against_its_ttl() -> None:
    """The ttl rule on an injected clock: live while the beat is younger than its ttl, stale after,
    live again once a newer beat comes."""
    record = replace(rec(), host="node-a")  # another host: its pid cannot be checked from here
    beat = Beat(at=1000.0, ttl_s=0.3, run_id="run-a")
    assert judge(record, beat, host="node-b", boot="b", now=1000.2).state == "live"
    late = judge(record, beat, host="node-b", boot="b", now=1000.5)
    assert late.state == "stale" and late.reason == "heartbeat older than its ttl" and late.age_s == 0.5
    assert judge(record, Beat(at=1000.5, ttl_s=0.3), host="node-b", boot="b", now=1000.6).state == "live"
    assert judge(record, None, host="node-b", boot="b", now=1000.0).reason == "no heartbeat"


def test_a_killed_publisher_is_stale_at_once_on_its_host(backend: Backend) -> None:
    child = subprocess.Popen([sys.executable, "-c", PUBLISHER, backend.url, SID, "child", "30"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "published"
        here, elsewhere = backend.open(), backend.open(host="node-b")
        [entry] = here.sources(SID, 0)
        assert entry.record.pid == child.pid and entry.state == "live"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        assert here.sources(SID, 0) == []  # same host, same boot: the pid is gone (ttl still has 30 s)
        assert here.sources(SID, 0, include_stale=True)[0].reason == "process gone"
        assert workers(elsewhere.sources(SID, 0)) == ["child"]  # another host only knows the ttl
        assert elsewhere.reap(grace_s=0) == 0
        assert here.reap(grace_s=60) == 1  # a gone process needs no grace
        assert here.all_sources() == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_unpublish_is_idempotent_and_final(backend: Backend) -> None:
    reg = backend.open()
    with reg.publish(rec()) as pub:
        assert workers(reg.sources(SID, 0)) == ["w0"]
    assert reg.sources(SID, 0, include_stale=True) == []
    pub.unpublish()
    assert pub.heartbeat() is False
    assert reg.sources(SID, 0, include_stale=True) == []


def test_heartbeat_reports_a_removed_record_and_unpublish_spares_its_successor(backend: Backend) -> None:
    reg = backend.open()
    first = reg.publish(rec())
    assert reg.remove(SID, 0, "w0") is True and reg.remove(SID, 0, "w0") is False
    second = reg.publish(rec())  # the same worker id again, a new record (someone else's, say)
    first.unpublish()  # must not remove the second record
    assert [e.record for e in reg.sources(SID, 0)] == [second.record]
    assert first.heartbeat() is False
    second.unpublish()


def test_keep_alive_thread(backend: Backend) -> None:
    reg, other = backend.open(), backend.open(host="node-b")
    pub = reg.publish(rec(), ttl_s=60)  # long: whether a starved thread beats in time is not the question
    [first] = other.sources(SID, 0)
    pub.keep_alive(0.05)
    assert wait_for(lambda: other.sources(SID, 0)[0].heartbeat_at > first.heartbeat_at, 30)  # the thread beats
    assert workers(other.sources(SID, 0)) == ["w0"] and not pub.lost
    pub.unpublish()
    assert other.sources(SID, 0, include_stale=True) == []
    # a record removed under a running keep_alive: the thread sees it gone and stops
    pub2 = reg.publish(rec(worker="w1"), ttl_s=0.6)
    pub2.keep_alive(0.05)
    reg.remove(SID, 0, "w1")
    assert wait_for(lambda: pub2.lost, 60)
    assert other.sources(SID, 0, include_stale=True) == []
    pub2.unpublish()


def test_a_verify_request_is_answered_between_heartbeats(backend: Backend) -> None:
    """`peers --verify` waits for the source's thread: it looks for a request every VERIFY_POLL_S, not only
    at its beat (ttl/3 — here 200 s, so an answer that came with a beat would come after the test's wait)."""
    reg, other = backend.open(), backend.open(host="node-b")
    pub = reg.publish(rec(), ttl_s=600)
    beats = []
    real_beat = pub._beat
    pub._beat = lambda: beats.append(time.time()) or real_beat()
    pub.verifier = lambda: {"ok": True, "bad": [], "tensors": 1}
    pub.keep_alive()
    nonce = other.request_verify(SID, 0, "w0")
    assert wait_for(lambda: other.verify_answer(SID, 0, "w0", nonce) is not None, 120)
    assert other.verify_answer(SID, 0, "w0", nonce)["ok"] is True and beats == []
    pub.unpublish()


def test_republish_over_a_stale_record_of_the_same_worker(backend: Backend) -> None:
    reg = backend.open(host="node-b")
    old = reg.publish(rec(), ttl_s=0.2)
    time.sleep(0.4)
    new = reg.publish(rec(), ttl_s=30)
    [entry] = reg.sources(SID, 0)
    assert entry.record == new.record and entry.record.created_at > old.record.created_at
    assert old.heartbeat() is False  # the old handle never beats, nor removes, its successor's record
    old.unpublish()
    assert [e.record for e in reg.sources(SID, 0)] == [new.record]
    new.unpublish()


# ---- runs and reaping ----


def test_remove_run(backend: Backend) -> None:
    reg = backend.open()
    mine = [reg.publish(rec(rank=r, worker=f"m{r}", run_id="run-a")) for r in (0, 1)]
    mine.append(reg.publish(rec(sid=SID2, worker="m2", run_id="run-a")))
    theirs = reg.publish(rec(worker="t0", run_id="run-b"))
    assert reg.remove_run("run-a") == 3
    assert workers(reg.all_sources()) == ["t0"]
    assert reg.remove_run("run-a") == 0
    assert all(p.heartbeat() is False for p in mine)
    assert reg.remove_run("run-b") == 1
    assert theirs.heartbeat() is False and reg.all_sources() == []


def test_reap_removes_only_long_stale_records(backend: Backend) -> None:
    reg = backend.open(host="node-b")
    live = reg.publish(rec(worker="live"), ttl_s=30)
    reg.publish(rec(worker="stale"), ttl_s=0.2)
    time.sleep(0.4)
    assert reg.reap(grace_s=30) == 0  # stale, but not for 30 s yet
    assert sorted(workers(reg.all_sources())) == ["live", "stale"]
    assert reg.reap(grace_s=0) == 1
    assert workers(reg.all_sources()) == ["live"]
    live.unpublish()
    assert reg.reap(grace_s=0) == 0 and reg.all_sources() == []


# ---- corrupt records ----


def test_file_backend_refuses_corrupt_records(tmp_path: Path) -> None:
    reg = FileRegistry(tmp_path, host="node-b")
    good = reg.publish(rec(worker="good"))
    folder = reg.rank_dir(SID, 0)
    (folder / "garbage.json").write_text("{not json")
    (folder / "schema.json").write_text(json.dumps({**rec(worker="schema").to_json(), "schema": 99}))
    with open(folder / "huge.json", "wb") as fh:  # sparse: over the cap without using the disk
        fh.truncate(MAX_RECORD_BYTES + 1)
    (folder / "moved.json").write_text(json.dumps(rec(worker="elsewhere").to_json()))  # not where it says
    (folder / "link.json").symlink_to(folder / "good.json")
    (folder / "noise.txt").write_text("x")
    fresh = json.dumps({"at": time.time(), "ttl_s": 30, "run_id": "run-a"})
    for name in ("garbage", "schema", "huge", "moved", "link"):
        (folder / f"{name}.beat").write_text(fresh)
    assert workers(reg.sources(SID, 0, include_stale=True)) == ["good"]
    assert workers(reg.all_sources()) == ["good"]
    assert reg.reap(grace_s=0) == 0  # unreadable but beating (a newer mxlaunch, say): kept
    old = json.dumps({"at": time.time() - 100, "ttl_s": 1, "run_id": "run-a"})
    for name in ("garbage", "schema", "huge", "moved"):
        (folder / f"{name}.beat").write_text(old)
    (folder / "link.beat").unlink()  # no heartbeat at all: the file's own age counts
    assert reg.reap(grace_s=10) == 4
    os.utime(folder / "link.json", (time.time() - 100,) * 2, follow_symlinks=False)
    assert reg.reap(grace_s=10) == 1
    assert sorted(p.name for p in folder.iterdir()) == ["good.beat", "good.json", "noise.txt"]
    assert workers(reg.sources(SID, 0)) == ["good"]
    outside = FileRegistry(tmp_path / "outside")
    outside.publish(rec(sid=SID2, worker="foreign"))  # valid records, in a folder outside this registry
    (reg.dir / SID2).symlink_to(outside.dir / SID2)
    assert workers(outside.sources(SID2, 0)) == ["foreign"]
    assert reg.sources(SID2, 0, include_stale=True) == [] and workers(reg.all_sources()) == ["good"]
    good.unpublish()


@pytest.mark.redis
def test_redis_backend_refuses_corrupt_records(redis_url: str) -> None:
    import redis

    from mxlaunch.coord.peers_redis import RedisRegistry

    db = redis.Redis.from_url(redis_url)
    db.flushdb()
    reg = RedisRegistry(redis_url, host="node-b")
    good = reg.publish(rec(worker="good"))
    key = f"mxlaunch:peers:{SID}:0"
    db.hset(key, mapping={"garbage": b"{not json", "binary": b"\xff\xfe", "moved": json.dumps(rec(worker="x").to_json()),
                          "schema": json.dumps({**rec(worker="schema").to_json(), "schema": 99})})
    db.hset(key, "huge", b" " * (MAX_RECORD_BYTES + 1))
    db.set(f"mxlaunch:beat:{SID}:0:schema", "{}", px=30_000)  # unreadable but beating: kept by reap
    db.sadd("mxlaunch:sources", "../bad:0", f"{SID}:x")  # index entries that are not keys of ours
    assert workers(reg.sources(SID, 0, include_stale=True)) == ["good"]
    assert workers(reg.all_sources()) == ["good"]
    db.hset(key, "../evil", json.dumps(rec().to_json()))  # a field that is no worker id
    assert reg.reap(grace_s=0) == 4
    assert sorted(k.decode() for k in db.hkeys(key)) == ["good", "schema"]
    assert db.smembers("mxlaunch:sources") == {f"{SID}:0".encode()}  # the foreign index entries are gone
    good.unpublish()


def test_file_registry_is_never_world_writable(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        pub = FileRegistry(tmp_path).publish(rec())
        pub.heartbeat()
    finally:
        os.umask(old)
    paths = [Path(d) / n for d, dirs, files in os.walk(tmp_path / ".peers") for n in dirs + files]
    assert paths and all(not stat.S_IMODE(os.lstat(p).st_mode) & 0o002 for p in paths)
    assert sorted(p.name for p in paths if p.is_file()) == ["w0.beat", "w0.json"]  # no temp files left
    pub.unpublish()


# ---- opening one ----


def test_open_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_REGISTRY", raising=False)
    assert open_registry(None, tmp_path).url == f"file:{tmp_path}"
    assert open_registry("file", tmp_path).url == f"file:{tmp_path}"
    assert open_registry(f"file:{tmp_path}/x", None).url == f"file:{tmp_path}/x"
    assert open_registry(f"file://{tmp_path}/y", None).url == f"file:{tmp_path}/y"
    monkeypatch.setenv("MXLAUNCH_REGISTRY", f"file:{tmp_path}/env")
    assert open_registry(None, tmp_path).url == f"file:{tmp_path}/env"
    for bad in ("file:relative", "http://x", "s3://bucket"):
        with pytest.raises(UsageError):
            open_registry(bad, tmp_path)
    with pytest.raises(UsageError, match=r"cannot reach the peer registry at redis://:\*\*\*@127\.0\.0\.1:1/0"):
        open_registry("redis://:secret@127.0.0.1:1/0", None)
    assert "secret" not in redact_url("rediss://user:secret@h:6380/2")


def test_missing_redis_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` raises ImportError
    with pytest.raises(UsageError) as info:
        open_registry("redis://:pw@127.0.0.1:6379/0", None)
    assert "pip install 'mxlaunch[redis]'" in info.value.one_line()


@pytest.mark.redis
def test_open_registry_redis(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXLAUNCH_REGISTRY", redis_url)
    reg = open_registry(None, None)
    assert reg.url == redis_url and isinstance(reg, PeerRegistry)
    assert base64.b64decode(rec().agent_metadata) == b"\x00nixl-agent-md"
