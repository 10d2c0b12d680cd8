"""The stop watchdog (launch/stop_watchdog.py) with real processes and real signals: a launcher whose
main thread is stuck still ends after its deadline — engine group killed, run folder gone, its stacks
printed — and one that finishes its own stop is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

# A stand-in launcher: SIGTERM handler, a watchdog with a 1 s deadline, an "engine" in its own group and a
# "run folder"; then the main thread either gets stuck for good (a lock nobody releases) or finishes.
LAUNCHER = r"""
import os, shutil, signal, subprocess, sys, threading, time
from pathlib import Path
from mxlaunch.launch.stop_watchdog import StopWatchdog
run_dir, mode = Path(sys.argv[1]), sys.argv[2]
run_dir.mkdir()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))

def rescue():
    os.killpg(engine.pid, signal.SIGKILL)
    shutil.rmtree(run_dir)

dog = StopWatchdog(lambda: 1.0, rescue)
dog.start()
print(engine.pid, flush=True)

def stuck_in_a_system_call():
    lock = threading.Lock(); lock.acquire(); lock.acquire()  # never returns

if mode == "stuck":
    stuck_in_a_system_call()
while not got:
    time.sleep(0.05)
engine.kill(); engine.wait(); shutil.rmtree(run_dir)
dog.finished()
time.sleep(3)  # past the deadline: the watchdog must not fire after finished()
sys.exit(7)
"""


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir), mode], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    engine = int(proc.stdout.readline())
    return proc, engine, run_dir


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_stuck_stop_is_rescued_after_its_deadline(tmp_path: Path) -> None:
    proc, engine, run_dir = start(tmp_path, "stuck")
    time.sleep(0.5)  # into the stuck call (if the signal came first the stop is just as stuck)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not run_dir.exists() and gone(engine)
    assert "mxlaunch watchdog: the stop after SIGTERM did not end in time" in err
    assert "stuck_in_a_system_call" in err  # the stuck thread's stack, for whoever reads the job's output


def test_a_stop_that_finishes_is_left_alone(tmp_path: Path) -> None:
    proc, engine, run_dir = start(tmp_path, "ok")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 7 and "watchdog" not in err, err
    assert not run_dir.exists() and gone(engine)


def test_sigusr2_prints_the_threads_and_changes_nothing(tmp_path: Path) -> None:
    proc, engine, run_dir = start(tmp_path, "ok")
    proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 60
    while "Thread" not in (err := proc.stderr.readline()):  # faulthandler's dump, first line
        assert time.monotonic() < deadline and err != "", "no stack dump on SIGUSR2"
    assert proc.poll() is None  # still running
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 7
