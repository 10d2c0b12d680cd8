"""Live mode: our process handling (own process group, arrival times, SIGINT→SIGTERM→SIGKILL),
driven by a fake engine that prints real vLLM 0.32 lines with sleeps (fixtures_logs/fake_vllm_engine.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from mxlaunch.profile.live import run_live

FAKE = Path(__file__).resolve().parent / "fixtures_logs" / "fake_vllm_engine.py"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_soon(pid: int, seconds: float = 3.0) -> bool:
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
    assert 1.0 < run.total_seconds < 10.0  # the fake engine sleeps ~1.4 s in all
    assert run.seconds("interpreter_startup") >= 0.25  # its 0.3 s sleep before the first line (the imports)
    assert run.seconds("process_startup") >= 0.35  # its 0.4 s sleep from there to the EngineCore line
    assert run.seconds("weight_loading") == 0.31  # the engine's own figure, not the arrival gap
    assert _gone_soon(int(pid_file.read_text()))  # the engine's child was stopped with it


def test_stubborn_group_gets_sigkill(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    run, _ = run_live([sys.executable, str(FAKE), "--stubborn", "--child-pid-file", str(pid_file)], timeout=30,
                      grace=(0.3, 0.3))
    assert run.ready
    assert _gone_soon(int(pid_file.read_text()))
    assert time.monotonic() - started < 15


def test_command_that_exits_before_ready(tmp_path: Path) -> None:
    run, code = run_live([sys.executable, str(FAKE), "--mode", "crash"], timeout=30, grace=(1.0, 1.0))
    assert run.ready is False and code == 3
    assert run.seconds("weight_loading") is not None  # it was loading when it died: the phases it saw
    assert run.seconds("process_startup") >= 0.35


def test_timeout_stops_a_hung_start(tmp_path: Path) -> None:
    started = time.monotonic()
    run, code = run_live([sys.executable, str(FAKE), "--mode", "hang"], timeout=2.5, grace=(0.5, 0.5))
    assert run.ready is False and code is None
    assert 2.0 <= run.total_seconds <= 3.0
    assert time.monotonic() - started < 10


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
