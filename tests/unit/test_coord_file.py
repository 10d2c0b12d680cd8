"""File claims: one winner among real racing processes, leases that expire when the holder dies, heartbeats."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mxlaunch.coord.file as coord_file
from mxlaunch.coord.base import Claim, ClaimInfo, Coordinator
from mxlaunch.coord.file import FileCoordinator
from mxlaunch.coord.file import ensure_dir, pid_alive, write_json_atomic
from mxlaunch.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
SID = "0123456789abcdef"

# A racer: wait for the start signal, try to claim SID-0 .. SID-(n-1) as fast as it can, print the indexes it
# won as JSON, then hold its claims (heartbeating if asked) until stdin closes. Many ids per racer make the
# racers collide often even on two cores.
RACER = r"""
import json, os, sys, time
from mxlaunch.coord.file import FileCoordinator
root, n, go, host, ttl, beat = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]), float(sys.argv[6])
coord = FileCoordinator(root, host=host or None, grace_s=0.5)
print("ready", flush=True)
while not os.path.exists(go):
    pass
claims = {}
for i in range(n):
    claim = coord.try_claim(f"{sys.argv[7]}-{i}" if n > 1 else sys.argv[7], ttl_s=ttl)
    if claim:
        claims[i] = claim
        if beat > 0:
            claim.keep_alive(beat)
print(json.dumps(sorted(claims)), flush=True)
sys.stdin.read()
for claim in claims.values():
    claim.release()
"""


def spawn(root: Path, go: Path, host: str = "", ttl: float = 30.0, beat: float = 0.0, n: int = 1) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RACER, str(root), str(n), str(go), host, str(ttl), str(beat), SID],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )


def race(root: Path, procs_n: int, **kwargs) -> tuple[list[subprocess.Popen[str]], list[list[int]]]:
    go = root / f"go-{time.monotonic_ns()}"
    procs = [spawn(root, go, **kwargs) for _ in range(procs_n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    return procs, [json.loads(p.stdout.readline()) for p in procs]


def finish(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
    for p in procs:
        p.wait(timeout=120)


class FakeClock:
    """Stands in for the `time` module mxlaunch/coord/file.py reads: time() is whatever the test set."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):  # anything else the module might read: the real one
        return getattr(time, name)


def fake_clock(monkeypatch: pytest.MonkeyPatch, now: float) -> FakeClock:
    clock = FakeClock(now)
    monkeypatch.setattr(coord_file, "time", clock)
    return clock


def no_temp_files(root: Path) -> bool:
    names = [n for _, _, files in os.walk(root / ".claims") for n in files]
    return all(n.endswith(".claim") and not n.startswith(".") for n in names)


def test_generations_probe(tmp_path: Path) -> None:
    coord = FileCoordinator(tmp_path, host="node-a", grace_s=0.0)
    assert coord.newest_gen(SID) == 0
    for expected in range(1, 40):
        claim = coord.try_claim(SID)
        assert claim is not None and claim.gen == expected == coord.newest_gen(SID)
        assert coord.try_claim(SID) is None
        claim.release()
        assert coord.holder(SID) is None


def assert_one_winner_each(won: list[list[int]], n: int) -> None:
    flat = sorted(i for w in won for i in w)
    assert flat == list(range(n)), f"ids won twice or never: {flat}"


def test_protocols_are_met(tmp_path: Path) -> None:
    coord = FileCoordinator(tmp_path)
    assert isinstance(coord, Coordinator)
    claim = coord.try_claim(SID)
    assert isinstance(claim, Claim)
    claim.release()


def test_racing_processes_one_winner(tmp_path: Path) -> None:
    n = 120
    procs, won = race(tmp_path, 5, n=n)
    try:
        assert_one_winner_each(won, n)
        for k in (0, n - 1):
            holder = FileCoordinator(tmp_path).holder(f"{SID}-{k}")
            winner = next(p for p, w in zip(procs, won) if k in w)
            assert holder is not None and holder.pid == winner.pid
    finally:
        finish(procs)
    assert FileCoordinator(tmp_path).holder(f"{SID}-0") is None  # released on exit
    assert no_temp_files(tmp_path)


def test_sigkilled_holder_same_host_is_taken_over_at_once(tmp_path: Path) -> None:
    procs, results = race(tmp_path, 1)
    assert results == [[0]]
    coord = FileCoordinator(tmp_path)
    assert coord.try_claim(SID) is None
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    claim = coord.try_claim(SID, ttl_s=30)  # the lease has 30 s left, but its holder is gone on this host
    assert claim is not None and claim.info.pid == os.getpid()
    claim.release()


def test_sigkilled_holder_elsewhere_expires_after_ttl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    procs, results = race(tmp_path, 1, host="node-a", ttl=60.0)  # long: every real-clock read is well inside it
    assert results == [[0]]
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    coord = FileCoordinator(tmp_path, grace_s=0.5)
    assert coord.try_claim(SID) is None  # another host: only the lease can say it died
    held = coord.holder(SID)
    assert held is not None and held.host == "node-a"
    clock = fake_clock(monkeypatch, held.expires_at + 0.5 - 0.1)  # lease over, still inside the grace
    assert coord.holder(SID) is not None and coord.try_claim(SID) is None
    clock.now = held.expires_at + 0.5 + 0.1  # past expires_at + grace
    assert coord.holder(SID) is None
    claim = coord.try_claim(SID)
    assert claim is not None and claim.gen == 2
    claim.release()


def test_heartbeat_keeps_the_claim_past_its_ttl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    procs, results = race(tmp_path, 1, host="node-a", ttl=60.0, beat=0.05)  # long ttl, fast beats
    coord = FileCoordinator(tmp_path, grace_s=0.3)
    try:
        assert results == [[0]]
        first = coord.holder(SID)
        assert first is not None and first.host == "node-a"
        deadline = time.monotonic() + 60
        while (later := coord.holder(SID)).expires_at <= first.expires_at:  # the beat moves the lease on
            assert time.monotonic() < deadline, "the heartbeat never extended the lease"
            assert coord.try_claim(SID) is None
            time.sleep(0.05)
        assert coord.try_claim(SID) is None
        procs[0].send_signal(signal.SIGKILL)  # heartbeats stop: the lease runs out
        procs[0].wait()
        last = coord.holder(SID)
        assert last is not None and last.expires_at >= later.expires_at
        clock = fake_clock(monkeypatch, (first.expires_at + last.expires_at) / 2 + 0.3)
        assert coord.try_claim(SID) is None  # past the first lease + grace: only the heartbeat keeps it held
        clock.now = last.expires_at + 0.3 + 0.1  # past the last beat's lease + grace
        claim = coord.try_claim(SID)
        assert claim is not None
        claim.release()
    finally:
        finish(procs)


def test_takeover_of_stale_claims_has_one_winner(tmp_path: Path) -> None:
    n = 120
    coord = FileCoordinator(tmp_path)
    for i in range(n):  # dead holders on another host whose leases ended long ago
        stale = ClaimInfo(f"{SID}-{i}", "dead", "node-z", 1, "boot", 0, 0.0, time.time() - 60, 1.0)
        ensure_dir(coord.claim_dir(f"{SID}-{i}"))
        write_json_atomic(coord.gen_path(f"{SID}-{i}", 1), stale.to_json())
    procs, won = race(tmp_path, 5, n=n)
    try:
        assert_one_winner_each(won, n)
        assert {coord.newest_gen(f"{SID}-{i}") for i in range(n)} == {2}
    finally:
        finish(procs)
    assert no_temp_files(tmp_path)


def test_heartbeat_after_takeover_reports_lost(tmp_path: Path) -> None:
    a = FileCoordinator(tmp_path, host="node-a", grace_s=0.1)
    b = FileCoordinator(tmp_path, host="node-b", grace_s=0.1)
    claim = a.try_claim(SID, ttl_s=0.3)
    assert claim is not None
    time.sleep(0.5)  # past the ttl however loaded the machine is
    assert claim.heartbeat() is False and claim.lost  # never writes after its own expiry
    other = b.try_claim(SID, ttl_s=30)
    assert other is not None
    claim.release()  # must not remove b's claim
    assert b.holder(SID) is not None and b.holder(SID).token == other.token
    other.release()
    assert b.holder(SID) is None


def test_keep_alive_thread_and_release(tmp_path: Path) -> None:
    coord = FileCoordinator(tmp_path, host="node-a", grace_s=0.1)
    with coord.try_claim(SID, ttl_s=60, extra={"capture_id": "c1"}) as claim:  # long: a starved thread is not the question
        first = FileCoordinator(tmp_path, host="node-b").holder(SID)
        claim.keep_alive(0.05)
        deadline = time.monotonic() + 30
        while FileCoordinator(tmp_path, host="node-b").holder(SID).expires_at <= first.expires_at:  # the thread beats
            assert time.monotonic() < deadline, "the keep-alive thread never extended the lease"
            time.sleep(0.05)
        assert not claim.lost
        holder = FileCoordinator(tmp_path, host="node-b").holder(SID)
        assert holder is not None and holder.extra == {"capture_id": "c1"}
    assert coord.holder(SID) is None


def test_unreadable_claim_counts_as_held_until_old(tmp_path: Path) -> None:
    coord = FileCoordinator(tmp_path)
    ensure_dir(coord.claim_dir(SID))
    path = coord.gen_path(SID, 1)
    path.write_text("{not json")
    assert coord.try_claim(SID) is None
    old = time.time() - 3600
    os.utime(path, (old, old))
    claim = coord.try_claim(SID)
    assert claim is not None
    assert claim.gen == 2 and json.loads(claim.path.read_text())["token"] == claim.token
    claim.release()


def test_bad_ids_and_ttl_are_usage_errors(tmp_path: Path) -> None:
    coord = FileCoordinator(tmp_path)
    for bad in ("../x", "a/b", ".hidden", "", "a..b"):
        with pytest.raises(UsageError):
            coord.try_claim(bad)
    with pytest.raises(UsageError):
        coord.try_claim(SID, ttl_s=0)


def test_pid_alive_sees_dead_zombie_and_reused(tmp_path: Path) -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # wait until it exited, but leave it unreaped
    stat_text = Path(f"/proc/{proc.pid}/stat").read_text()
    assert stat_text[stat_text.rindex(")") + 2] == "Z"  # still there as a zombie, which counts as dead
    assert not pid_alive(proc.pid)
    proc.wait()
    assert not pid_alive(proc.pid)
    assert not pid_alive(os.getpid(), start_time=1)  # same pid, other start time: reused


def test_claim_files_never_world_writable(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        claim = FileCoordinator(tmp_path / "store").try_claim(SID)
    finally:
        os.umask(old)
    for path in (tmp_path / "store", tmp_path / "store" / ".claims", claim.path):
        assert not os.stat(path).st_mode & stat.S_IWOTH, path
    claim.release()


def test_shared_group_sets_setgid_and_group_rw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXLAUNCH_GROUP", str(os.getgid()))
    claim = FileCoordinator(tmp_path / "store").try_claim(SID)
    folder = os.stat(tmp_path / "store" / ".claims")
    assert folder.st_gid == os.getgid() and folder.st_mode & stat.S_ISGID and folder.st_mode & 0o070 == 0o070
    f = os.stat(claim.path)
    assert f.st_mode & 0o060 == 0o060 and not f.st_mode & stat.S_IWOTH
    claim.release()
    monkeypatch.setenv("MXLAUNCH_GROUP", "no-such-group-mxlaunch")
    with pytest.raises(UsageError):
        FileCoordinator(tmp_path / "store2").try_claim(SID)
