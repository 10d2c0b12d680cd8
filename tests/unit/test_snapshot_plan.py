"""`launch --dry-run --engine-snapshot` says what the run will do with the snapshot (issue 42): restore, take, or
why not — the same answers as the run's EngineSnapshots, decided without writing anything."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mxlaunch.warmstart import criu, engine_snapshots, snapshot_plan
from mxlaunch.warmstart.engine_snapshots import EngineSnapshots
from tests.helpers.cli import run_cli

ARGV = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]


@pytest.fixture()
def usable_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU as if usable here (the capability is root's): both sides ask the same module."""
    monkeypatch.setattr(criu, "why_not", lambda environ=os.environ, status_text=None: ("/bin/true", ""))
    monkeypatch.setattr(engine_snapshots, "socket_blocker", lambda *a: None)
    monkeypatch.setattr(snapshot_plan, "socket_blocker", lambda *a: None)


def test_the_plan_says_take_then_restore_with_the_key_the_run_uses_and_writes_nothing(
        tmp_path: Path, usable_criu: None) -> None:
    snaps = tmp_path / "snaps"
    env = {"MXLAUNCH_ENGINE_SNAPSHOTS": str(snaps), "PATH": "/usr/bin"}
    first = snapshot_plan.plan_engine_snapshot(ARGV, "src", env)
    assert first["status"] == "take" and "no snapshot for this command yet" in first["reason"], first
    assert not snaps.exists()  # no folder, no salt: a plan writes nothing

    run = EngineSnapshots(True, list(ARGV), "src", tmp_path / "shm", tmp_path / "log", lambda *a, **k: None,
                          environ=env)  # the run makes the folder and the salt, and keys the command
    assert run.dumpable and run.key
    second = snapshot_plan.plan_engine_snapshot(ARGV, "src", env)
    assert second["status"] == "take" and second["key"] == run.key, (second, run.key)

    folder = snaps / str(os.getuid()) / run.key  # a published snapshot for that key (find: its meta.json)
    folder.mkdir(mode=0o700)
    (folder / "meta.json").write_text(json.dumps({"bytes": 3 << 30}))
    restore = snapshot_plan.plan_engine_snapshot(ARGV, "src", env)
    assert restore["status"] == "restore" and restore["path"] == str(folder) and "3.0 GiB" in restore["reason"]
    other = snapshot_plan.plan_engine_snapshot(ARGV, "src", {**env, "VLLM_X": "1"})  # the key holds the environment
    assert other["status"] == "take" and other["key"] != run.key


def test_a_lean_snapshot_is_looked_for_in_the_store_and_restored_only_for_a_staged_plan(
        tmp_path: Path, usable_criu: None) -> None:
    store = tmp_path / "store"
    env = {"MXLAUNCH_SNAPSHOT_SLEEP": "lean", "PATH": "/usr/bin"}  # no MXLAUNCH_ENGINE_SNAPSHOTS: the store's folder
    run = EngineSnapshots(True, list(ARGV), "src", tmp_path / "shm", tmp_path / "log", lambda *a, **k: None,
                          environ=env, store_root=store)
    planned = snapshot_plan.plan_engine_snapshot(ARGV, "src", env, store_root=store)
    folder = store / "engine-snapshots" / str(os.getuid()) / run.key
    assert planned["status"] == "take" and planned["key"] == run.key and planned["path"] == str(folder), planned
    folder.mkdir(mode=0o700)
    (folder / "meta.json").write_text(json.dumps({"lean": True, "bytes": 1 << 30}))
    assert snapshot_plan.plan_engine_snapshot(ARGV, "src", env, store_root=store, strategy="staged")["status"] == "restore"
    skipped = snapshot_plan.plan_engine_snapshot(ARGV, "src", env, store_root=store, strategy="capture")
    assert skipped["status"] == "off" and "staged snapshot" in skipped["reason"], skipped


def test_a_snapshots_folder_open_to_others_is_the_reason_as_the_run_gives_it(tmp_path: Path, usable_criu: None) -> None:
    root = tmp_path / "snaps" / str(os.getuid())
    root.mkdir(parents=True, mode=0o755)
    root.chmod(0o755)
    planned = snapshot_plan.plan_engine_snapshot(ARGV, "src", {"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps")})
    assert planned["status"] == "off" and "chmod 700" in planned["reason"], planned
    assert os.stat(root).st_mode & 0o777 == 0o755  # judged, not changed


def test_the_dry_run_without_criu_says_why_in_text_and_json(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    env = {**os.environ, "MXLAUNCH_CRIU": str(tmp_path / "no-criu"), "MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "s"),
           "COLUMNS": "1000"}  # one printed line per plan line
    args = ("launch", "--dry-run", "--engine-snapshot", "--artifact-path", str(tmp_path / "store"), "--", *ARGV[:-1],
            str(model))
    text = run_cli(*args, env=env)
    assert text.returncode == 0, text.stderr
    line = next(line for line in text.stdout.splitlines() if line.startswith("engine snapshot"))
    assert line.startswith("engine snapshot off: MXLAUNCH_CRIU=") and "is not executable" in line, text.stdout
    assert "--no-engine-fork" not in text.stdout  # issue 42: no flag forced spawn here
    data = json.loads(run_cli(*args[:2], "--json", *args[2:], env=env).stdout)
    assert data["engine_snapshot"]["status"] == "off" and "not executable" in data["engine_snapshot"]["reason"]
    assert not (tmp_path / "s").exists()
