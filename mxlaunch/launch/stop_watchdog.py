"""A stop that ends inside the scheduler's grace even when the launcher's main thread is stuck.

The launcher's stop runs in its main thread, after Python's signal handler. A main thread blocked in a
system call (an NFS or Lustre stat, a write throttled behind dirty pages) runs neither: Slurm then
SIGKILLs the job KillWait seconds later, before /dev/shm is cleaned or the job script has profiled the
log. This watchdog hears the signal where C does (`signal.set_wakeup_fd`: the interpreter's own signal
handler writes each signal's number into a pipe, whatever the main thread is doing), and once the budget
plus half the margin has passed without the launcher finishing, it prints every thread's stack (so the
cause is in the job's output), SIGKILLs the engine's process group, removes the run folder from /dev/shm,
and exits the launcher with 128 + the signal. Outside Slurm the budget is the usual stop sequence's.

`faulthandler` also prints every thread's stack on SIGUSR2, at any time: `kill -USR2 <launcher pid>`.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STACKS_SIGNAL = signal.SIGUSR2


class StopWatchdog:
    """Armed by `start()` in the main thread; `finished()` once the launcher's own cleanup is done."""

    def __init__(self, deadline_s: Callable[[], float], rescue: Callable[[], None]) -> None:
        self._deadline_s = deadline_s  # seconds after the first stop signal before the rescue
        self._rescue = rescue  # what the launcher would have cleaned (engine group, /dev/shm)
        self._done = threading.Event()
        self._r: Optional[int] = None
        self._w: Optional[int] = None
        self._previous_fd = -1
        self.fired = False

    def start(self) -> None:
        """Must run in the main thread (set_wakeup_fd's rule), after the launcher installed its handlers."""
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        try:
            faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
        except (RuntimeError, ValueError, OSError):
            pass
        threading.Thread(target=self._watch, name="mx-stop-watchdog", daemon=True).start()

    def finished(self) -> None:
        self._done.set()
        if self._r is not None:
            signal.set_wakeup_fd(self._previous_fd)
            if self._w is not None:
                os.close(self._w)  # wakes the watcher, which closes the read end
                self._w = None

    def _watch(self) -> None:
        assert self._r is not None
        signum = 0
        try:
            while not signum:
                select.select([self._r], [], [])
                data = os.read(self._r, 64)
                if not data or self._done.is_set():
                    return
                signum = next((b for b in data if b in STOP_SIGNALS), 0)
            if self._done.wait(self._deadline_s()):
                return
            self.fired = True
            self._rescue_and_exit(signum)
        except OSError:
            return
        finally:
            try:
                os.close(self._r)
            except OSError:
                pass

    def _rescue_and_exit(self, signum: int) -> None:
        """The rescue first, then the stacks (written to fd 2 straight, in a thread of their own: a main
        thread stuck writing to the same file holds its lock), then the exit, whatever the write does."""
        try:
            self._rescue()
        finally:
            def report() -> None:
                name = signal.Signals(signum).name
                os.write(2, f"mxlaunch watchdog: the stop after {name} did not end in time; engine killed, run "
                            f"folder removed, exit {128 + signum}; the launcher's threads:\n".encode())
                faulthandler.dump_traceback(file=2, all_threads=True)

            writer = threading.Thread(target=report, name="mx-stop-report", daemon=True)
            writer.start()
            writer.join(1.0)
            os._exit(128 + signum)


def deadline_after_signal(budget_s: Optional[float], kill_wait: Optional[int], usual_s: float,
                          margin_s: float) -> float:
    """When the rescue comes: the stop's budget plus half the margin kept before Slurm's SIGKILL (in a
    Slurm job), else the usual stop sequence plus 20 s (the kernel-cache capture's 10 s after it, and more)."""
    if kill_wait is None or budget_s is None:
        return usual_s + 20.0
    return budget_s + margin_s / 2
