"""`launch --keep-staged` (staging/kept.py): the files a launch staged stay in /dev/shm as hard links, and the
next launch of the same snapshot on the node links them instead of reading the store — only files of this
user's, in folders of this user's alone, that are what the plan asks for. Real files, real links; the launcher
end to end with a stand-in engine that loads by waiting for its files and writing its marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from mxlaunch.staging import kept

pytestmark = pytest.mark.unit


def _stage(folder: Path, files: dict[str, bytes]) -> dict[str, dict]:
    """Files as a stage leaves them (rank/name), and the plan's expectations of them."""
    expected = {}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
        expected[rel] = {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    return expected


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "mxlaunch-0"
    root.mkdir(mode=0o700)
    return root


def test_kept_files_are_links_and_the_next_launch_links_them_instead_of_reading(tmp_path: Path) -> None:
    root = _root(tmp_path)
    stage = root / "run1" / "stage"
    expected = _stage(stage, {"0/part-0.safetensors": b"a" * 5000, "0/part-1.safetensors": b"b" * 3000})
    assert kept.keep(root, "sid", stage, expected) == 8000
    kept_file = kept.kept_root(root) / "sid" / "0" / "part-0.safetensors"
    assert os.stat(kept_file).st_ino == os.stat(stage / "0" / "part-0.safetensors").st_ino  # a link, not a copy
    os.unlink(stage / "0" / "part-0.safetensors")  # the launch frees its stage: the kept link holds the data
    dest = root / "run2" / "stage"
    got = kept.reuse(root, "sid", expected, dest)
    assert sorted(got.rels) == sorted(expected) and got.bytes == 8000
    assert (dest / "0" / "part-0.safetensors").read_bytes() == b"a" * 5000
    [entry] = kept.entries(root)
    assert (entry.source_id, entry.bytes, entry.files) == ("sid", 8000, 2)


def test_only_what_the_plan_asks_for_is_reused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    expected = _stage(root / "run1" / "stage", {"0/a": b"a" * 100, "0/b": b"b" * 100, "0/c": b"c" * 100})
    kept.keep(root, "sid", root / "run1" / "stage", expected)
    other = {**expected, "0/a": {**expected["0/a"], "xxh3_128": "0" * 32}}  # the store's file of that name changed
    (kept.kept_root(root) / "sid" / "0" / "b").write_bytes(b"b" * 10)  # cut short since it was kept
    got = kept.reuse(root, "sid", other, root / "run2" / "stage")
    assert got.rels == ["0/c"] and got.bytes == 100
    assert kept.reuse(root, "another-sid", expected, root / "run3" / "stage").rels == []
    (root / "outside").write_bytes(b"o" * 100)  # a name that climbs out of the kept folder is never followed
    climbing = {"../../outside": {"bytes": 100, "xxh3_128": xxhash.xxh3_128(b"o" * 100).hexdigest()}}
    recorded = json.loads((kept.kept_root(root) / "sid" / kept.FILES).read_text())
    (kept.kept_root(root) / "sid" / kept.FILES).write_text(json.dumps({**recorded, **climbing}))
    assert kept.reuse(root, "sid", climbing, root / "run4" / "stage" / "deep" / "er").rels == []


def test_a_kept_folder_others_can_enter_is_not_believed(tmp_path: Path) -> None:
    root = _root(tmp_path)
    expected = _stage(root / "run1" / "stage", {"0/a": b"a" * 100})
    kept.keep(root, "sid", root / "run1" / "stage", expected)
    os.chmod(kept.kept_root(root) / "sid", 0o777)  # anyone could have swapped a file in
    assert kept.reuse(root, "sid", expected, root / "run2" / "stage").rels == []
    assert kept.entries(root) == []


def test_eviction_drops_the_least_recently_used_others_first(tmp_path: Path) -> None:
    root = _root(tmp_path)
    for i, sid in enumerate(("old", "mid", "new")):
        expected = _stage(root / f"run-{sid}" / "stage", {"0/a": bytes([i]) * 1000})
        kept.keep(root, sid, root / f"run-{sid}" / "stage", expected)
        used = time.time() - 1000 + i * 100
        os.utime(kept.kept_root(root) / sid / kept.USED, (used, used))
    assert kept.evict(root, 1500, keep_id="old") == ["mid", "new"]  # "old" is this launch's own: never dropped
    assert [e.source_id for e in kept.entries(root)] == ["old"]


def test_the_reaper_of_dead_runs_leaves_the_kept_folder_alone(tmp_path: Path) -> None:
    from mxlaunch.launch.cleanup import reap_stale_runs

    root = _root(tmp_path)
    expected = _stage(root / "run1" / "stage", {"0/a": b"a" * 100})
    kept.keep(root, "sid", root / "run1" / "stage", expected)
    old = time.time() - 3600  # no owner.json and an hour old: what a dead launcher's folder looks like
    os.utime(kept.kept_root(root), (old, old))
    os.utime(root / "run1", (old, old))
    reaped = [p.name for p, _ in reap_stale_runs(root, tmp_path)]
    assert reaped == ["run1"] and kept.entries(root)[0].source_id == "sid"


STAND_IN = '''
import json, os, sys, time
plan = json.load(open(os.environ["MXLAUNCH_PLAN"]))
files = [f["path"] for f in plan["ranks"]["0"]]
deadline = time.monotonic() + 60
while not all(os.path.exists(p) for p in files) and time.monotonic() < deadline:
    time.sleep(0.02)
print("seen", sum(os.path.getsize(p) for p in files), flush=True)
with open(os.path.join(plan["run_dir"], "markers", "loaded-0.json"), "w") as f:
    json.dump({"bytes": 1}, f)
while any(os.path.exists(p) for p in files) and time.monotonic() < deadline:  # the launcher frees its stage
    time.sleep(0.02)
'''


def test_a_second_launch_of_the_snapshot_reads_nothing_from_the_store(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.launch import process
    from mxlaunch.launch.run import Launcher
    from tests.unit.test_launch_restored import staged_launcher

    def stand_in(argv: list[str], env: dict, dumpable: bool = False) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", STAND_IN], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    monkeypatch.setattr(process, "start", stand_in)
    runs: list[list[tuple[str, dict]]] = []
    for _ in range(2):
        runner, events = staged_launcher(tmp_path, monkeypatch, fresh=not runs)
        runner.opts.keep_staged = True
        assert runner.run() == 0, events
        runs.append(events)
    first = [f for e, f in runs[0] if e in ("staged", "kept")]
    assert first[0]["bytes"] == 4096 and "kept_bytes" not in first[0], first  # read from the store
    assert [f.get("status") for f in first[1:]] == ["kept"] and first[1]["bytes"] == 4096, first
    [second] = [f for e, f in runs[1] if e == "staged"]
    assert second["bytes"] == 0 and second["kept_bytes"] == 4096, second  # nothing read: linked
    assert [e.source_id for e in kept.entries(runner.shm_dir.parent)] == [runner.plan.source_id]
    assert not runner.shm_dir.exists()  # the run folder went as always; the kept entry stays


def test_mxlaunch_kept_lists_and_drops_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from mxlaunch.cli.app import app
    from mxlaunch.launch import cleanup

    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path)
    root = tmp_path / cleanup.shm_user_name()
    root.mkdir(mode=0o700)
    expected = _stage(root / "run1" / "stage", {"0/a": b"a" * 2048})
    kept.keep(root, "sid1", root / "run1" / "stage", expected)
    listed = CliRunner().invoke(app, ["kept", "--json"])
    assert listed.exit_code == 0, listed.output
    doc = json.loads(listed.output)
    assert [(k["source_id"], k["bytes"], k["files"]) for k in doc["kept"]] == [("sid1", 2048, 1)] and doc["dropped"] == []
    shown = CliRunner().invoke(app, ["kept"])
    assert "sid1" in shown.output and "kept" in shown.output
    dropped = CliRunner().invoke(app, ["kept", "--drop", "--json"])
    assert json.loads(dropped.output)["dropped"] == ["sid1"] and kept.entries(root) == []


def test_a_dry_run_says_how_much_of_the_stage_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`launch --dry-run --keep-staged` answers before anything runs: the bytes the next start would link."""
    from typer.testing import CliRunner

    from mxlaunch.cli.app import app
    from mxlaunch.launch import cleanup
    from tests.unit.test_launch_restored import staged_launcher

    runner, _ = staged_launcher(tmp_path, monkeypatch)  # a store with a published snapshot of 4096 bytes
    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path / "shm2")
    (tmp_path / "shm2").mkdir()
    root = tmp_path / "shm2" / cleanup.shm_user_name()
    root.mkdir(mode=0o700)
    [f] = runner.plan.stage_files
    rank_rel = "0/part-00000.safetensors"
    expected = {rank_rel: {"bytes": f.bytes, "xxh3_128": f.xxh3_128}}
    (root / "run1" / "stage" / "0").mkdir(parents=True)
    (root / "run1" / "stage" / rank_rel).write_bytes(b"x" * 4096)
    argv = ["launch", "--dry-run", "--json", "--keep-staged", "--artifact-path", str(runner.opts.artifact_path), "--",
            *runner.plan.spec.argv]
    before = json.loads(CliRunner().invoke(app, argv).output)
    assert before["strategy"] == "staged" and before["kept_bytes"] == 0
    kept.keep(root, runner.plan.source_id, root / "run1" / "stage", expected)
    after = json.loads(CliRunner().invoke(app, argv).output)
    assert after["kept_bytes"] == 4096, after


def test_any_launch_whose_stage_lacks_room_drops_other_kept_snapshots(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch without --keep-staged still gets the room: kept snapshots of other models give way (least
    recently used first) instead of sending its engine to the slow default loader."""
    from mxlaunch.launch import process
    from mxlaunch.staging import capacity
    from tests.unit.test_launch_restored import staged_launcher

    runner, events = staged_launcher(tmp_path, monkeypatch)
    root = runner.shm_dir.parent
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    expected = _stage(root / "old-run" / "stage", {"0/a": b"a" * 8192})
    kept.keep(root, "another-model", root / "old-run" / "stage", expected)
    real = capacity.capacity_of
    monkeypatch.setattr(capacity, "capacity_of", lambda dest: type("Cap", (), {"usable": 1000})()
                        if kept.entries(root) else real(dest))  # no room while the other model is kept
    monkeypatch.setattr(process, "start", lambda argv, env, dumpable=False: subprocess.Popen(
        [sys.executable, "-c", STAND_IN], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True))
    assert runner.run() == 0, events
    assert kept.entries(root) == []
    [evicted] = [f for e, f in events if e == "kept"]
    assert evicted["status"] == "evicted" and evicted["source_ids"] == ["another-model"], evicted
    assert [f["bytes"] for e, f in events if e == "staged"] == [4096]  # then staged as usual


def test_files_staged_under_a_group_umask_are_kept_and_reused(tmp_path: Path) -> None:
    """A stage under umask 002 (shared-group clusters) writes 0664 files; kept as they are, reuse (which
    refuses a file others can write) would never link them while they held their RAM."""
    root = _root(tmp_path)
    old = os.umask(0o002)
    try:
        expected = _stage(root / "run1" / "stage", {"0/a": b"a" * 100})
        os.chmod(root / "run1" / "stage" / "0" / "a", 0o664)
    finally:
        os.umask(old)
    kept.keep(root, "sid", root / "run1" / "stage", expected)
    assert kept.available(root, "sid", expected) == 100
    assert kept.reuse(root, "sid", expected, root / "run2" / "stage").rels == ["0/a"]
