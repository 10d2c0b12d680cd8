"""The launcher around an engine it did not start (a restored engine snapshot) and around its exit (issue 42):
what it reports must be this run's, and nothing after its `exit` event. The engine here is a stand-in process;
the snapshot's own mechanics are tests/unit/test_engine_snapshot.py's."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch.run import Launcher
from mxlaunch.store.core import Store


def checkpoint(folder: Path) -> Path:
    """config.json + one real safetensors file: what make_plan reads."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    return folder


class Restored(subprocess.Popen):
    """Stands in for engine_snapshot.RestoredEngine: Popen-like, with the meta a restore reads."""

    meta: dict = {}


def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Launcher, list[tuple[str, dict]]]:
    from mxlaunch.launch import cleanup

    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path / "shm")
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "kc"))
    store = Store(tmp_path / "store")
    plan = make_plan([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      str(checkpoint(tmp_path / "model"))], LaunchOptions(artifact_path=store.root), store)
    events: list[tuple[str, dict]] = []
    opts = LaunchOptions(artifact_path=store.root, run_dir=tmp_path / "logs", ready_timeout=60)
    return Launcher(plan, opts, emit=lambda e, **f: events.append((e, f)), echo=lambda line: None, store=store), events


def restore_as(runner: Launcher, monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """The launcher's snapshot restore hands back a process running `code`."""
    def restored(*_: Any, **__: Any) -> Restored:
        return Restored([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True)

    monkeypatch.setattr(runner.snapshots, "try_restore", restored)
    monkeypatch.setattr(runner.snapshots, "refill", lambda *a, **k: True, raising=False)


def test_a_restored_engine_gets_no_kernel_cache_restore_or_capture(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runner, events = launcher(tmp_path, monkeypatch)
    assert runner.kernel.active  # planned: a miss on this fresh node
    restore_as(runner, monkeypatch, "pass")
    assert runner.run() == 0
    [cache] = [f for e, f in events if e == "kernel-cache"]
    assert cache["status"] == "off" and "restored from its snapshot" in cache["reason"], events
    assert not runner.kernel.active and not [e for e, _ in events if e == "kernel-cache-capture"]


def test_the_exit_event_is_the_launchers_last_even_when_its_cleanup_still_reports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: `zygote-image status=published` came after `exit` (the zygote's maker is waited for in the
    cleanup, which ran after the exit event)."""
    runner, events = launcher(tmp_path, monkeypatch)
    restore_as(runner, monkeypatch, "raise SystemExit(3)")
    monkeypatch.setattr(runner.zygotes, "abandon", lambda wait_s: runner.emit("zygote-image", status="abandoned"))
    assert runner.run() == 3
    names = [e for e, _ in events]
    assert names[-1] == "exit" and names.count("exit") == 1 and "zygote-image" in names, names
    assert events[-1][1] == {"code": 3}


def test_a_zygote_image_maker_reports_before_abandon_returns_and_never_after(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.warmstart import zygote, zygote_image

    monkeypatch.setattr(zygote, "SHM_ROOT", tmp_path)
    (tmp_path / f"mxlaunch-zygote-{os.getuid()}").mkdir(mode=0o700)
    events: list[tuple[str, dict]] = []
    waiting = zygote_image.ImageMaker("/bin/false", os.getpid(), "k1", tmp_path / "store", tmp_path / "zygote.log",
                                      tmp_path / "criu", lambda e, **f: events.append((e, f)))
    waiting.start()  # unclaimed: this "zygote" never says it has imported
    waiting.abandon(wait_s=60.0)
    assert [(e, f["status"]) for e, f in events] == [("zygote-image", "failed")], events  # said by now

    events.clear()
    release = threading.Event()

    def stuck() -> dict:  # a claimed dump still under way when the launcher stops
        release.wait(60.0)
        return {"dump_s": 1.0}

    busy = zygote_image.ImageMaker("/bin/false", os.getpid(), "k2", tmp_path / "store", tmp_path / "zygote.log",
                                   tmp_path / "criu", lambda e, **f: events.append((e, f)))
    monkeypatch.setattr(busy, "_make", stuck)
    busy._claimed = True
    busy.start()
    busy.abandon(wait_s=0.1)
    assert [(e, f["status"]) for e, f in events] == [("zygote-image", "abandoned")], events
    release.set()
    busy.join(60.0)
    assert not busy.is_alive() and busy.result == {"dump_s": 1.0}
    assert [f["status"] for _, f in events] == ["abandoned"], events  # its late "published" is not said


def test_a_dumpable_engine_does_not_inherit_the_launchers_stdin() -> None:
    """CRIU refuses to dump a tree holding a terminal ("tty: Found slave peer index 0 without correspond master
    peer": `launch --engine-snapshot` from an interactive shell), and a restore would hand the engine only a dead
    copy of the first launcher's stdin: a dumpable start reads /dev/null. Here the launcher's stdin is a pipe."""
    from mxlaunch.launch import process

    show = [sys.executable, "-c", "import os; print(os.readlink('/proc/self/fd/0'))"]
    r, w = os.pipe()
    saved = os.dup(0)
    try:
        os.dup2(r, 0)
        dumpable, plain = process.start(show, dumpable=True), process.start(show)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, r, w):
            os.close(fd)
    assert dumpable.communicate(timeout=60)[0].decode().strip() == "/dev/null"
    assert plain.communicate(timeout=60)[0].decode().startswith("pipe:")  # a usual start keeps the launcher's


def staged_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    fresh: bool = True) -> tuple[Launcher, list[tuple[str, dict]]]:
    """A launcher whose plan is `staged`: the store holds a published snapshot of the model (`fresh`: made
    now; else the one an earlier call made)."""
    from mxlaunch.launch import cleanup
    from mxlaunch.store.core import SnapshotMeta

    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path / "shm")
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "kc"))
    store = Store(tmp_path / "store")
    model = tmp_path / "model"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint(model) if fresh else model)]
    opts = LaunchOptions(artifact_path=store.root, run_dir=tmp_path / "logs", ready_timeout=60)
    if fresh:
        sid = make_plan(argv, opts, store).source_id
        with store.begin_capture(sid, SnapshotMeta(engine="vllm", engine_version="0.32.0"), nranks=1) as writer:
            (writer.rank_dir(0) / "part-00000.safetensors").write_bytes(b"x" * 4096)
            writer.add_rank_dir(0)
            assert writer.mark_node_done()
    plan = make_plan(argv, opts, store)
    assert plan.strategy == "staged", plan.reason
    events: list[tuple[str, dict]] = []
    return Launcher(plan, opts, emit=lambda e, **f: events.append((e, f)), echo=lambda line: None, store=store), events


@pytest.mark.parametrize("lean", [True, False])
def test_a_lean_restore_has_its_weights_staging_while_criu_restores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    lean: bool) -> None:
    """On the H200 the lean restore (CRIU 1.5-2.6 s + the GPU) and the stage its refill reads (5 s) ran one after
    the other: the stage now starts first. A full snapshot holds its weights: nothing is staged for it."""
    runner, _ = staged_launcher(tmp_path, monkeypatch)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(runner.snapshots, "lean_ahead", lambda strategy: lean and strategy == "staged")

    def restored(strategy: str) -> Restored:
        seen["staging"] = runner.stage_job is not None
        seen["plan"] = json.loads((runner.shm_dir / "plan.json").read_text()) if lean else None
        proc = Restored([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True)
        proc.meta = {"lean": lean}
        return proc

    monkeypatch.setattr(runner.snapshots, "try_restore", restored)
    monkeypatch.setattr(runner.snapshots, "refill", lambda *a, **k: True, raising=False)
    assert runner.run() == 0
    assert seen["staging"] is lean, seen
    if lean:  # the refill's plan is the staged one, written before the restore
        assert seen["plan"]["strategy"] == "staged" and seen["plan"]["ranks"]["0"], seen["plan"]


def test_a_lean_restore_stages_its_image_before_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From one disk, the image and the weights read side by side kept CRIU waiting 5.7 s for a 2.7 GB image on
    the H200's wiped node: the image is copied first, then the weights stage while CRIU restores."""
    runner, _ = staged_launcher(tmp_path, monkeypatch)
    order: list[str] = []
    monkeypatch.setattr(runner.snapshots, "lean_ahead", lambda strategy: True)
    reserved: list[int] = []

    def image_ahead(strategy: str, reserve_bytes: int = 0) -> None:
        order.append("image" if runner.stage_job is None else "image after weights")
        reserved.append(reserve_bytes)

    monkeypatch.setattr(runner.snapshots, "stage_image_ahead", image_ahead)

    def restored(strategy: str) -> Restored:
        order.append("restore" if runner.stage_job is not None else "restore without a stage")
        proc = Restored([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True)
        proc.meta = {"lean": True}
        return proc

    monkeypatch.setattr(runner.snapshots, "try_restore", restored)
    monkeypatch.setattr(runner.snapshots, "refill", lambda *a, **k: True, raising=False)
    assert runner.run() == 0
    assert order == ["image", "restore"], order
    assert reserved == [runner.plan.stage_bytes] and reserved[0] > 0  # room left for the weights after it


def test_a_failed_refill_leaves_no_loaded_marker_for_the_engine_started_after_it(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A refill that failed at its check may have written rank 0's `loaded` marker: the engine started instead
    must not have rank 0's staged files freed before it read them."""
    from mxlaunch.contract import marker_name
    from mxlaunch.launch import process

    runner, events = staged_launcher(tmp_path, monkeypatch)
    monkeypatch.setattr(runner.snapshots, "lean_ahead", lambda strategy: True)
    proc = Restored([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
    proc.meta = {"lean": True}
    monkeypatch.setattr(runner.snapshots, "try_restore", lambda strategy: proc)

    def failed_refill(plan_file: Path) -> bool:
        (runner.shm_dir / "markers" / marker_name("loaded", 0)).write_text(json.dumps({"bytes": 4096}))
        return False

    started: dict[str, Any] = {}

    def start(argv: list[str], env: dict, dumpable: bool = False) -> subprocess.Popen:
        started["markers"] = sorted(p.name for p in (runner.shm_dir / "markers").iterdir())
        return subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    monkeypatch.setattr(runner.snapshots, "refill", failed_refill, raising=False)
    monkeypatch.setattr(process, "start", start)
    runner.run()
    assert started["markers"] == [], started


def test_lean_ahead_reads_the_snapshot_its_restore_would_use(tmp_path: Path) -> None:
    """Only a lean snapshot of this key, in this user's private folder, and only for a staged launch."""
    from mxlaunch.warmstart.engine_snapshot import META, snapshots_root
    from mxlaunch.warmstart.engine_snapshots import EngineSnapshots

    snaps = EngineSnapshots(False, [], "sid", tmp_path / "shm", tmp_path / "logs", lambda e, **f: None,
                            environ={"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps")})
    snaps.binary, snaps.key = "/bin/true", "k1"
    root = snapshots_root(snaps.root_env)
    (root / "k1").mkdir(parents=True)
    os.chmod(root, 0o700)
    (root / "k1" / META).write_text(json.dumps({"lean": False}))
    assert not snaps.lean_ahead("staged")  # a full snapshot holds its weights
    (root / "k1" / META).write_text(json.dumps({"lean": True}))
    assert snaps.lean_ahead("staged") and not snaps.lean_ahead("capture")
    os.chmod(root, 0o755)  # a folder others can enter is not trusted to hold an image
    assert not snaps.lean_ahead("staged")


def test_no_lean_restore_when_its_stage_could_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refill would wait for files that never land (minutes): the engine starts as usual at once."""
    from mxlaunch.launch import process

    runner, events = staged_launcher(tmp_path, monkeypatch)
    monkeypatch.setattr(runner.snapshots, "lean_ahead", lambda strategy: True)
    asked: list[str] = []
    monkeypatch.setattr(runner.snapshots, "try_restore", lambda strategy: asked.append(strategy))

    def no_stage() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "_start_stage", no_stage)
    started: list[list[str]] = []
    monkeypatch.setattr(process, "start", lambda argv, env, dumpable=False: started.append(argv) or subprocess.Popen(
        [sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True))
    dropped: list[bool] = []
    monkeypatch.setattr(runner.snapshots, "drop_ahead", lambda: dropped.append(True))
    runner.run()
    assert asked == [] and len(started) == 1, (asked, started)
    assert dropped == [True]  # the image copied ahead of the stage is not left in the run folder
    assert any(e == "fallback" and "No space left" in f["reason"] for e, f in events), events


class Killable(Restored):
    def kill_tree(self) -> None:
        self.kill()
        self.wait(timeout=30)


def test_a_stop_during_the_restore_stops_the_restored_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM arriving while CRIU restores: the launcher exits 128+15 and the engine it restored goes too."""
    import signal as sig

    runner, _ = staged_launcher(tmp_path, monkeypatch)
    procs: list[Killable] = []

    def restored(strategy: str) -> Killable:
        procs.append(Killable([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        procs[-1].meta = {"lean": False}
        runner.signals.append(sig.SIGTERM)  # what the relay records when the signal comes
        return procs[-1]

    monkeypatch.setattr(runner.snapshots, "try_restore", restored)
    assert runner.run() == 128 + sig.SIGTERM
    assert procs and procs[0].poll() is not None  # not left serving without a launcher


def test_the_room_left_for_the_weights_counts_what_the_last_launch_kept(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept files are in /dev/shm already (linked, not read): the image's copy leaves room only for the rest."""
    from mxlaunch.staging import kept

    runner, _ = staged_launcher(tmp_path, monkeypatch)
    total = runner.plan.stage_bytes
    assert runner._stage_bytes_to_read() == total > 0
    runner.opts.keep_staged = True
    monkeypatch.setattr(kept, "available", lambda root, sid, expected: 10 if sid == runner.plan.source_id
                        and set(expected) == set(runner.plan.stage_expected()) else 0)
    assert runner._stage_bytes_to_read() == total - 10
