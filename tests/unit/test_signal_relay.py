"""Stop signals' work runs outside the handler (mxlaunch/signal_relay.py): a handler that needs a lock the
interrupted code holds would hang the process for good — a launcher in CI hung so on scancel's second SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

# The main thread holds the very lock the stop work needs (an Event's), and the signal comes right then:
# the state the CI hang was in. The handler must return at once; the work waits for the lock in its thread.
CHILD = textwrap.dedent("""
    import os, signal, threading
    from mxlaunch.signal_relay import SignalRelay
    ev = threading.Event()
    with SignalRelay((signal.SIGTERM,), deferred=lambda s: ev.set()) as relay:
        with ev._cond:                        # what Event.set holds while it runs
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # and a second one, as scancel sent
            print("handlers returned", relay.received, ev.is_set(), flush=True)
        print("work done", ev.wait(10), flush=True)
""")


def test_a_signal_while_the_stop_work_s_lock_is_held_does_not_hang() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["handlers returned [15, 15] False", "work done True"], proc.stdout


def test_the_old_way_hangs_which_is_why_the_relay_exists() -> None:
    """The same state with the work done in the handler itself (the launcher's code until 2026-12-02): stuck."""
    child = textwrap.dedent("""
        import os, signal, threading
        ev = threading.Event()
        signal.signal(signal.SIGTERM, lambda s, f: ev.set())
        with ev._cond:
            os.kill(os.getpid(), signal.SIGTERM)
        print("never")
    """)
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=5, cwd=REPO)


def test_the_handlers_before_the_block_are_back_after_it_and_its_thread_is_gone() -> None:
    import signal

    from mxlaunch.signal_relay import SignalRelay

    def mine(_s: int, _f: object) -> None:
        pass

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        with SignalRelay((signal.SIGUSR1,)) as relay:
            assert signal.getsignal(signal.SIGUSR1) == relay._handler
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert relay._thread is not None and not relay._thread.is_alive()  # its pipe closed: the relay ended
    finally:
        signal.signal(signal.SIGUSR1, previous)
