"""Live mode: our process handling (own process group, arrival times, SIGINT→SIGTERM→SIGKILL),
driven by a fake engine that prints real vLLM 0.32 lines with sleeps (fixtures_logs/fake_vllm_engine.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mxlaunch.profile.live import run_live
from mxlaunch.profile.profiler import PHASES, StartupProfiler

FAKE = Path(__file__).resolve().parent / "fixtures_logs" / "fake_vllm_engine.py"


def _line(proc: str, msg: str, where: str) -> str:  # as the fake engine prints them
    return f"({proc} pid=123) INFO 01-02 03:04:05 [{where}] {msg}"


# What the fake engine prints, grouped by the sleep each group follows (0.3 s, 0.4 s, 0.3 s, ...): each
# group with the arrival time a reader that is never starved gives it (seconds since spawn).
FAKE_OUTPUT = [
    (0.3, [_line("APIServer", "non-default args: {'model_tag': '/models/tiny', 'model': '/models/tiny', "
                              "'enforce_eager': True}", "utils.py:286")]),
    (0.7, [_line("EngineCore", "Initializing a V1 LLM engine (v0.32.0) with config: model='/models/tiny'", "core.py:133")]),
    (1.0, [_line("Worker", "world_size=1 rank=0 local_rank=0 distributed_init_method=file:///tmp/x backend=gloo",
                 "parallel_state.py:1906"),
           _line("Worker", "rank 0 in world size 1 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0, "
                           "ETP rank 0", "parallel_state.py:2350"),
           _line("Worker", "Starting to load model /models/tiny...", "cpu_model_runner.py:68")]),
    (1.3, ["Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]",
           "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 3.3it/s]",
           _line("Worker", "Loading weights took 0.31 seconds", "default_loader.py:501")]),
    (1.5, [_line("EngineCore", "init engine (profile, create kv cache, warmup model) took 0.20 s", "core.py:402")]),
    (1.7, [_line("APIServer", "Starting vLLM server on http://0.0.0.0:8011", "entry.py:140"),
           "INFO:     Started server process [123]", "INFO:     Waiting for application startup.",
           "INFO:     Application startup complete."]),
]
# The phases the fake engine's output gives, in the report's order.
FAKE_PHASES = ["interpreter_startup", "process_startup", "worker_spawn", "dist_init", "weight_loading",
               "kv_cache_alloc", "http_startup", "warmup", "unknown"]


def _fed(arrivals: list[float]):
    prof = StartupProfiler(engine="auto", live=True)
    for t, (_, lines) in zip(arrivals, FAKE_OUTPUT):
        for text in lines:
            prof.feed(text, t)
    return prof.result()


def test_live_phases_are_timed_by_arrival() -> None:
    """The arrival logic on given arrival times (a live run's depend on how soon its reader thread runs)."""
    run = _fed([t for t, _ in FAKE_OUTPUT])
    assert run.ready and run.engine == "vllm" and run.total_seconds == pytest.approx(1.7)
    assert [p.name for p in run.phases] == FAKE_PHASES
    assert run.seconds("interpreter_startup") == pytest.approx(0.3)  # spawn → the first line
    assert run.seconds("process_startup") == pytest.approx(0.4)  # the first line → the EngineCore line
    assert run.seconds("worker_spawn") == pytest.approx(0.3)  # → the first worker line
    assert run.seconds("weight_loading") == 0.31  # the engine's own figure, not the arrival gap (0.3)
    assert run.seconds("http_startup") == pytest.approx(0.2)
    # a starved reader reads the first two groups at once: the gap between them is gone, the engine's
    # own figures are not
    late = _fed([0.7, 0.7, 1.0, 1.3, 1.5, 1.7])
    assert late.seconds("interpreter_startup") == pytest.approx(0.7) and late.seconds("process_startup") == 0.0
    assert late.seconds("weight_loading") == 0.31 and late.total_seconds == pytest.approx(1.7)


def test_a_restored_start_reports_the_launchers_restore_not_a_slow_interpreter() -> None:
    """A start restored from a CRIU image prints its first line only once the launcher has restored it (and
    refilled a lean one's weights): those are phases of their own, taken out of interpreter_startup, and the
    total is unchanged — `unknown` does not grow either."""
    prof = StartupProfiler(engine="auto", live=True)
    prof.launcher_phase("image_restore", 0.5)
    prof.launcher_phase("refill", 0.25)
    for t, (_, lines) in zip([1.0, 1.4, 1.7, 2.0, 2.2, 2.4], FAKE_OUTPUT):  # the fake engine 0.7 s later
        for text in lines:
            prof.feed(text, t)
    run = prof.result()
    assert [p.name for p in run.phases] == ["image_restore", "refill", *FAKE_PHASES]
    assert run.seconds("image_restore") == 0.5 and run.seconds("refill") == 0.25
    assert run.seconds("interpreter_startup") == pytest.approx(0.25)  # the first line at 1.0, less 0.75
    assert run.total_seconds == pytest.approx(2.4) and run.seconds("unknown") == pytest.approx(0.0, abs=1e-6)
    # nothing counted twice (weight_loading is the engine's 0.31 s against a 0.3 s gap between arrivals)
    assert sum(p.seconds for p in run.phases) == pytest.approx(2.41)


def test_a_start_that_dies_keeps_the_phases_it_saw() -> None:
    prof = StartupProfiler(engine="auto", live=True)
    for t, lines in FAKE_OUTPUT[:3]:
        for text in lines:
            prof.feed(text, t)
    for text in FAKE_OUTPUT[3][1][:2] + ["Traceback (most recent call last):", "RuntimeError: out of memory"]:
        prof.feed(text, 1.3)  # the fake's crash mode: it dies while loading the weights
    run = prof.result()
    assert not run.ready and run.total_seconds == pytest.approx(1.3)
    assert run.seconds("process_startup") == pytest.approx(0.4)
    assert run.seconds("weight_loading") == pytest.approx(0.3)  # from its begin line to the last line seen


def _in_report_order(names: list[str]) -> bool:
    return names == sorted(names, key=PHASES.index)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_soon(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_ready_run_is_timed_by_arrival_and_its_group_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    run, code = run_live([sys.executable, str(FAKE), "--child-pid-file", str(pid_file)], timeout=30,
                         grace=(2.0, 2.0))
    assert run.ready and code is None and run.engine == "vllm"  # "vllm" is not in argv: detected from output
    # lower bounds only (a loaded machine makes arrivals later, never earlier); the arrival gaps themselves
    # are test_live_phases_are_timed_by_arrival's
    assert run.total_seconds >= 1.7 - 0.05  # the fake engine sleeps 1.7 s before its ready line
    assert run.seconds("interpreter_startup") >= 0.25  # its 0.3 s sleep before the first line (the imports)
    names = [p.name for p in run.phases]
    assert names == FAKE_PHASES and _in_report_order(names)  # every phase it printed, in order
    assert run.seconds("weight_loading") == 0.31  # the engine's own figure, not the arrival gap
    assert _gone_soon(int(pid_file.read_text()))  # the engine's child was stopped with it


def test_stubborn_group_gets_sigkill(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    run, _ = run_live([sys.executable, str(FAKE), "--stubborn", "--child-pid-file", str(pid_file)], timeout=30,
                      grace=(0.3, 0.3))
    assert run.ready
    assert _gone_soon(int(pid_file.read_text()))  # it ignores SIGINT and SIGTERM (and sleeps 600 s): SIGKILL
    assert time.monotonic() - started < 120  # a hang guard only


def test_command_that_exits_before_ready(tmp_path: Path) -> None:
    run, code = run_live([sys.executable, str(FAKE), "--mode", "crash"], timeout=30, grace=(1.0, 1.0))
    assert run.ready is False and code == 3
    assert run.seconds("weight_loading") is not None  # it was loading when it died: the phases it saw
    names = [p.name for p in run.phases]
    assert {"interpreter_startup", "process_startup", "worker_spawn", "weight_loading"} <= set(names)
    assert _in_report_order(names) and "http_startup" not in names  # it never got that far


def test_timeout_stops_a_hung_start(tmp_path: Path) -> None:
    started = time.monotonic()
    run, code = run_live([sys.executable, str(FAKE), "--mode", "hang"], timeout=2.5, grace=(0.5, 0.5))
    took = time.monotonic() - started
    assert run.ready is False and code is None
    assert 2.5 - 1e-6 <= run.total_seconds <= took  # ran to the timeout; not extended past the run itself
    assert took < 120  # a hang guard only: the hung engine sleeps 600 s


def test_cli_live_runs_twice_with_stats() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mxlaunch.cli", "profile", "--runs", "2", "--timeout", "30", "--json", "--",
         sys.executable, str(FAKE)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert len(doc["runs"]) == 2 and all(r["ready"] for r in doc["runs"])
    assert doc["stats"]["weight_loading"]["n"] == 2 and doc["stats"]["weight_loading"]["mean"] == 0.31
    assert "run 2/2" in result.stderr  # progress goes to stderr


def test_cli_live_crash_exits_1() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mxlaunch.cli", "profile", "--json", "--", sys.executable, str(FAKE), "--mode", "crash"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["runs"][0]["ready"] is False
    assert "exited 3 before ready" in result.stderr and "Traceback" not in result.stderr


def test_cli_live_missing_command_exits_2() -> None:
    result = subprocess.run([sys.executable, "-m", "mxlaunch.cli", "profile", "--", "/no/such/engine"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr
