"""Stopping inside Slurm's KillWait and leaving nothing in /dev/shm: the KillWait parser on real
`scontrol show config` output, the stop budget, reaping the segments a killed launcher recorded, and a
real launcher stopping a stubborn engine group within the budget after SIGTERM."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mxlaunch.launch import cleanup, process
from mxlaunch.launch.shutdown import USUAL_STEPS, StopBudget, read_budget
from mxlaunch.slurm import parse_kill_wait
from tests.unit.test_launch_plan import serve, write_checkpoint

PY = sys.executable
FIXTURES = Path(__file__).resolve().parent
CONFIG = FIXTURES / "fixtures_slurm" / "scontrol-show-config-22.05.txt"  # the test cluster's, KillWait=15
FAKE = FIXTURES / "fixtures_logs" / "fake_vllm_engine.py"


# ---- KillWait --------------------------------------------------------------------------------------

def test_kill_wait_is_read_from_real_scontrol_output() -> None:
    text = CONFIG.read_text()
    assert "KillWait                = 15 sec" in text  # the line as Slurm 22.05 prints it
    assert parse_kill_wait(text) == 15
    assert parse_kill_wait(text.replace("= 15 sec", "= 30 sec")) == 30  # Slurm's default
    # KillOnBadExit, UnkillableStepTimeout and friends must not be mistaken for it
    assert parse_kill_wait("\n".join(line for line in text.splitlines() if not line.startswith("KillWait"))) is None
    assert parse_kill_wait("") is None


def test_the_stop_budget_fits_inside_kill_wait_with_a_margin() -> None:
    for kill_wait in (15, 30, 60, 120):
        budget = StopBudget(kill_wait, "test")
        steps = budget.steps()
        assert steps[0][0] is None and steps[-1][0] == signal.SIGKILL  # the forwarded signal first, SIGKILL last
        total = sum(wait for _, wait in steps)
        assert total == pytest.approx(budget.seconds)
        assert kill_wait - total >= max(3.0, 0.2 * kill_wait) - 1e-9, kill_wait  # room left for the cleanup
    assert StopBudget(15, "test").seconds == 12.0
    assert StopBudget(2, "test").seconds == 1.0  # never below a second
    assert StopBudget(None, "outside").steps() == USUAL_STEPS  # outside Slurm: 20 s, SIGTERM 10 s, SIGKILL 5 s
    assert StopBudget(None, "outside").describe() == {"budget_s": 35.0, "from": "outside"}
    assert StopBudget(15, "scontrol show config").describe() == {"kill_wait_s": 15, "budget_s": 12.0,
                                                                 "from": "scontrol show config"}


def test_the_budget_comes_from_the_job_or_the_override() -> None:
    assert read_budget({}).kill_wait is None
    job = read_budget({"SLURM_JOB_ID": "7", "MXLAUNCH_KILL_WAIT": "15"})
    assert job.kill_wait == 15 and job.source == "MXLAUNCH_KILL_WAIT"
    fallback = read_budget({"SLURM_JOB_ID": "7", "PATH": "/nonexistent"})  # no scontrol to ask
    assert fallback.kill_wait == 30 and "default" in fallback.source


# ---- segments recorded by a launcher that was killed -----------------------------------------------

def dead_pid() -> int:
    proc = subprocess.Popen([PY, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_launch_reaps_the_segments_a_killed_run_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmp_path stands in for /dev/shm: a dead launcher's run folder with its segments.json, the segments
    it recorded (one still mapped by a live process, one replaced by a new file of the same name since),
    and segments nobody recorded."""
    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path)
    user = tmp_path / f"mxlaunch-{os.getuid()}"
    run = user / "job9-20261130-000000-abcdef"
    (run / "stage" / "0").mkdir(parents=True)
    (run / "stage" / "0" / "rank.safetensors").write_bytes(b"w" * 8192)
    (run / "owner.json").write_text(json.dumps({"pid": dead_pid(), "start_time": 1}))

    names = ["psm_dead0001", "vllm_dist_0a61d4-tp:0-[0-1]-cpushm_0", "sem.mp-dead", "psm_live0001", "psm_reused01"]
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 4096)
    (tmp_path / "psm_notours1").write_bytes(b"x" * 4096)  # not recorded: someone else's
    (tmp_path / "outside").write_bytes(b"x")
    record = cleanup.SegmentRecord(run, before={"psm_notours1", "outside"})
    record.update(force=True)
    doc = json.loads((run / cleanup.SEGMENTS).read_text())
    assert sorted(s["name"] for s in doc["segments"]) == sorted(names)
    # the recorded psm_reused01 went away and another file took its name: not the file that run made
    (tmp_path / "new").write_bytes(b"y" * 4096)  # made while the old one exists: another inode
    (tmp_path / "new").replace(tmp_path / "psm_reused01")
    # a recorded name that is a path, or not an engine segment, is never followed
    doc["segments"] += [{"name": "../psm_x/../outside", "ino": None}, {"name": "outside", "ino": None}]
    (run / cleanup.SEGMENTS).write_text(json.dumps(doc))

    live = tmp_path / "psm_live0001"
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        reaped = cleanup.reap_stale_runs(user)
    assert [(r, sorted(s)) for r, s in reaped] == [(run, sorted(["psm_dead0001", "vllm_dist_0a61d4-tp:0-[0-1]-cpushm_0",
                                                                  "sem.mp-dead"]))]
    assert not run.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"mxlaunch-{os.getuid()}", "outside", "psm_live0001",
                                                                 "psm_notours1", "psm_reused01"])


def test_a_live_launchers_recorded_segments_are_left_alone(tmp_path: Path) -> None:
    user = tmp_path / f"mxlaunch-{os.getuid()}"
    run = user / "mine"
    run.mkdir(parents=True)
    (run / "owner.json").write_text(json.dumps({"pid": os.getpid(), "start_time": 0}))
    (run / cleanup.SEGMENTS).write_text(json.dumps({"segments": [{"name": "psm_mine0001", "ino": None}]}))
    (tmp_path / "psm_mine0001").write_bytes(b"x")
    assert cleanup.reap_stale_runs(user) == []
    assert (tmp_path / "psm_mine0001").exists() and run.exists()


# ---- a real launcher, a real signal ----------------------------------------------------------------

def stubborn_engine_in_a_slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str):
    """A plan whose "engine" (fake_vllm_engine.py in `mode`) has a child that ignores SIGINT and SIGTERM,
    inside a Slurm job with KillWait 6 s. Returns the plan and the file the child writes its pid to."""
    from mxlaunch.launch.decide import LaunchOptions, make_plan

    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path / "shm")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("MXLAUNCH_KILL_WAIT", "6")
    plan = make_plan(serve(write_checkpoint(tmp_path / "model")), LaunchOptions(strategy="default"))
    child_pid = tmp_path / "child.pid"
    plan.argv = plan.spec.argv = [PY, str(FAKE), "--mode", mode, "--stubborn", "--child-pid-file", str(child_pid)]
    return plan, child_pid


class StopRecorder:
    """What the launcher asks of process.stop_group (its steps, or its grace) and the signals each call
    sends to the engine's group: the stop's plan, read instead of timed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict] = []
        real_stop, real_killpg = process.stop_group, os.killpg

        def stop_group(proc, grace=(15.0, 10.0), *, steps=None, since=None, interrupted=None):
            call = {"pgid": proc.pid, "steps": None if steps is None else list(steps), "grace": grace,
                    "since": since, "sent": []}
            self.calls.append(call)
            self._current = call
            try:
                return real_stop(proc, grace, steps=steps, since=since, interrupted=interrupted)
            finally:
                self._current = None

        def killpg(pgid: int, sig: int) -> None:
            if sig and self._current is not None and pgid == self._current["pgid"]:  # not group_alive's probe
                self._current["sent"].append(sig)
            return real_killpg(pgid, sig)

        self._current: dict | None = None
        monkeypatch.setattr(process, "stop_group", stop_group)
        monkeypatch.setattr(process.os, "killpg", killpg)

    def budgeted(self) -> dict:
        """The one stop within the KillWait budget (the call given explicit steps)."""
        [call] = [c for c in self.calls if c["steps"] is not None]
        return call


def assert_the_stop_fits_the_budget(call: dict, budget_s: float) -> None:
    steps = call["steps"]
    assert steps[0][0] is None and call["since"] is not None  # the signal already forwarded: waits from then
    assert steps[-1][0] == signal.SIGKILL and sum(wait for _, wait in steps) <= budget_s + 1e-9, steps
    assert call["sent"] and call["sent"][-1] == signal.SIGKILL  # the stubborn child made it go all the way


def assert_engine_and_run_folder_gone(child_pid: Path, run_dir: Path) -> None:
    import psutil

    try:
        assert psutil.Process(int(child_pid.read_text())).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    assert not run_dir.exists()


def test_sigterm_in_a_slurm_job_frees_staged_files_first_and_stops_within_kill_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's group holds a child that ignores SIGINT and SIGTERM (a worker stuck in start-up):
    only SIGKILL ends it. With KillWait 6 s the launcher must be done — engine group gone, staged files
    and run folder removed — inside those 6 s, and the staged files must be gone before it waits."""
    from mxlaunch.launch.decide import LaunchOptions
    from mxlaunch.launch.run import Launcher

    plan, child_pid = stubborn_engine_in_a_slurm_job(tmp_path, monkeypatch, "ready")
    recorder = StopRecorder(monkeypatch)
    events: list[tuple[str, dict]] = []
    sent: list[float] = []
    runner = None

    def emit(event: str, **fields: object) -> None:
        if event == "stopping":
            fields = {**fields, "stage_left": (runner.shm_dir / "stage").exists()}
        events.append((event, fields))

    def echo(line: str) -> None:
        if "Application startup complete" in line and not sent:
            staged = runner.shm_dir / "stage" / "0"
            staged.mkdir(parents=True)
            (staged / "part.safetensors").write_bytes(b"w" * (1 << 20))
            sent.append(time.monotonic())
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()

    opts = LaunchOptions(strategy="default", run_dir=tmp_path / "logs", ready_timeout=300, kernel_cache=False)
    runner = Launcher(plan, opts, emit=emit, echo=echo)
    code = runner.run()
    took = time.monotonic() - sent[0]
    stopping = next(f for e, f in events if e == "stopping")
    assert stopping["signal"] == "SIGTERM" and stopping["kill_wait_s"] == 6 and stopping["budget_s"] == 3.0
    assert stopping["from"] == "MXLAUNCH_KILL_WAIT" and stopping["stage_left"] is False
    assert_the_stop_fits_the_budget(recorder.budgeted(), stopping["budget_s"])  # 3 s of the 6 s KillWait
    assert took < 60, f"the launcher took {took:.1f} s after SIGTERM"  # a hang guard only
    assert code == 128 + signal.SIGTERM  # the fake engine's main process dies of SIGTERM; its child needed SIGKILL
    assert_engine_and_run_folder_gone(child_pid, runner.shm_dir)


def test_a_stop_signal_during_the_launchers_own_stop_gets_the_kill_wait_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher is already stopping a stubborn engine on its own (not ready in time: the usual
    20 + 10 + 5 s sequence) when Slurm's SIGTERM arrives: from then on KillWait rules — the engine group is
    gone and the run folder removed inside KillWait, not after the usual sequence."""
    from mxlaunch.launch.decide import LaunchOptions
    from mxlaunch.launch.run import Launcher

    plan, child_pid = stubborn_engine_in_a_slurm_job(tmp_path, monkeypatch, "hang")
    recorder = StopRecorder(monkeypatch)
    events: list[tuple[str, dict]] = []
    sent: list[float] = []

    def emit(event: str, **fields: object) -> None:
        events.append((event, fields))
        if event == "error" and "not ready" in str(fields.get("message")) and not sent:
            sent.append(time.monotonic() + 0.5)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()

    opts = LaunchOptions(strategy="default", run_dir=tmp_path / "logs", ready_timeout=2, kernel_cache=False)
    runner = Launcher(plan, opts, emit=emit, echo=lambda line: None)
    code = runner.run()
    took = time.monotonic() - sent[0]
    stopping = next(f for e, f in events if e == "stopping")
    assert stopping["signal"] == "SIGTERM" and stopping["kill_wait_s"] == 6 and stopping["budget_s"] == 3.0
    own, budgeted = recorder.calls[0], recorder.budgeted()
    assert own["steps"] is None and own["grace"] == (20.0, 10.0)  # first the usual sequence (20 + 10 + 5 s) ...
    assert signal.SIGKILL not in own["sent"]  # ... cut short by the signal before it got to SIGKILL
    assert recorder.calls.index(budgeted) > 0  # then the KillWait budget from the signal on
    assert_the_stop_fits_the_budget(budgeted, stopping["budget_s"])
    assert took < 60, f"the launcher took {took:.1f} s after SIGTERM"  # a hang guard only
    assert code == 1  # the stop was the launcher's own (not ready); the signal only hurried it
    assert_engine_and_run_folder_gone(child_pid, runner.shm_dir)


# ---- torch.distributed's FileStore file (vLLM's file:// rendezvous) ---------------------------------

def test_the_plugin_names_a_real_filestore_and_the_launcher_removes_it_once_unused(tmp_path: Path) -> None:
    """A real process group initialised through `file://` (as vLLM's workers do) names its file in the
    marker; the file outlives a worker that is stopped (as vLLM's are); the cleanup removes it only when nobody holds it."""
    markers = tmp_path / "markers"
    markers.mkdir()
    store_file = tmp_path / "vllm_dist_0123456789abcdef0123456789abcdef"
    script = (
        "import json, sys, torch.distributed as dist\n"
        "from mxlaunch.plugin.rank_markers import rendezvous_file\n"
        f"dist.init_process_group('gloo', init_method='file://{store_file}', rank=0, world_size=1)\n"
        f"open('{markers / 'loaded-0.json'}', 'w').write(json.dumps({{'rendezvous_file': rendezvous_file()}}))\n"
        "import os; os._exit(0)\n")  # a worker stopped by a signal: the store's destructor never runs
    since = time.time() - 1.0
    subprocess.run([PY, "-c", script], check=True, timeout=120)
    assert store_file.exists()  # left behind, as by vLLM
    assert cleanup.rendezvous_files(markers) == {str(store_file)}
    with open(store_file, "rb"):  # held open by a live process (this one): left alone
        assert cleanup.remove_rendezvous_files({str(store_file)}, since=since) == []
    assert store_file.exists()
    assert cleanup.remove_rendezvous_files({str(store_file)}, since=time.time() + 60) == []  # older than the run
    assert cleanup.remove_rendezvous_files({str(store_file)}, since=since) == [str(store_file)]
    assert not store_file.exists()


def test_only_plain_files_of_this_run_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    link_target = tmp_path / "precious"
    link_target.write_text("x")
    (tmp_path / "link").symlink_to(link_target)
    since = time.time() - 1.0
    asked = {str(folder), str(tmp_path / "link"), "relative/vllm_dist_x", str(tmp_path / "missing")}
    assert cleanup.remove_rendezvous_files(asked, since=since) == []
    assert folder.is_dir() and link_target.exists() and (tmp_path / "link").is_symlink()
