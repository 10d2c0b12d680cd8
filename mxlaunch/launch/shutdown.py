"""Stopping inside the scheduler's grace: how long a stop may take, and in which steps.

Slurm ends a job (scancel, the time limit) with SIGTERM to every process of it — the launcher and the
engine alike — and SIGKILL KillWait seconds later (30 s by default). A launcher still waiting for its
engine then dies before it cleans /dev/shm. So on a stop signal the launcher frees its staged files at
once (and a capture's copy in /dev/shm, cancelling its upload to the store: the capture is given up),
stops the engine within a budget that ends a margin before Slurm's SIGKILL, and cleans the rest
(segments, run folder) before store work; a segment still left is reaped by the next launch
(cleanup.py). Outside Slurm the sequence is the launcher's usual one: the signal received (forwarded to
the engine's group), 20 s; SIGTERM, 10 s; SIGKILL, 5 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Tuple

from mxlaunch import settings
from mxlaunch.launch import process
from mxlaunch.launch.ipc_leftovers import remove_engine_sockets
from mxlaunch.launch.p2p import unpublish_run
from mxlaunch.launch.cleanup import (
    SegmentRecord, free_staged, remove_orphaned_engine_shm, remove_rendezvous_files, remove_run,
    rendezvous_files)
from mxlaunch.launch.process import Step
from mxlaunch.launch.stop_watchdog import deadline_after_signal
from mxlaunch.slurm import kill_wait as scontrol_kill_wait

SLURM_DEFAULT_KILL_WAIT = 30  # slurm.conf's default, assumed when scontrol cannot tell
USUAL_STEPS: Tuple[Step, ...] = ((None, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))


def margin(kill_wait: float) -> float:
    """Seconds kept back from KillWait for the cleanup after the engine is gone and for the scheduler's
    own delays: 20 %, at least 3 s."""
    return max(3.0, 0.2 * kill_wait)


@dataclass(frozen=True)
class StopBudget:
    """How long a stop may take: KillWait (None outside Slurm) and where that number came from."""

    kill_wait: Optional[int]
    source: str

    @property
    def seconds(self) -> Optional[float]:
        """Signal → engine gone, at most (None: no limit but the usual sequence's)."""
        if self.kill_wait is None:
            return None
        return max(1.0, self.kill_wait - margin(self.kill_wait))

    def steps(self) -> Tuple[Step, ...]:
        """The stop sequence after a signal that was already forwarded to the engine's group: wait;
        SIGTERM, wait; SIGKILL, wait — all inside `seconds`."""
        total = self.seconds
        if total is None:
            return USUAL_STEPS
        kill = min(2.0, 0.2 * total)
        rest = total - kill
        return ((None, 0.6 * rest), (signal.SIGTERM, 0.4 * rest), (signal.SIGKILL, kill))

    def describe(self) -> dict:
        """The `stopping` event's fields: KillWait (in a Slurm job), the seconds the stop may take, why."""
        total = sum(wait for _, wait in self.steps())
        head = {} if self.kill_wait is None else {"kill_wait_s": self.kill_wait}
        return {**head, "budget_s": round(total, 1), "from": self.source}


def read_budget(environ: Mapping[str, str] = os.environ) -> StopBudget:
    """Outside a Slurm job: no KillWait. Inside: $MXLAUNCH_KILL_WAIT, else `scontrol show config`, else
    Slurm's default."""
    if not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return StopBudget(None, "not in a Slurm job")
    override = settings.kill_wait(environ)
    if override is not None:
        return StopBudget(override, settings.KILL_WAIT)
    found = scontrol_kill_wait()
    if found is not None:
        return StopBudget(found, "scontrol show config")
    return StopBudget(SLURM_DEFAULT_KILL_WAIT, "Slurm's default (scontrol show config did not say)")


class BudgetReader:
    """`read_budget` in a thread started with the launch, so that scontrol never delays the engine; `get`
    waits for it briefly once a stop signal asks."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self._environ = dict(environ)
        self._budget: Optional[StopBudget] = None
        self._thread = threading.Thread(target=self._read, name="mx-kill-wait", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self._budget = read_budget(self._environ)

    def get(self, timeout: float = 1.0) -> StopBudget:
        self._thread.join(timeout)
        if self._budget is not None:
            return self._budget
        return StopBudget(SLURM_DEFAULT_KILL_WAIT, "Slurm's default (scontrol show config was too slow)")


class Stopping:
    """The launcher's stop and cleanup (mixed into launch/run.py's Launcher, whose state it uses)."""

    proc: Optional[subprocess.Popen]
    stage_job: Any
    plan: Any  # launch/decide.py LaunchPlan (its p2p decision: which registry to clean)
    run_id: str
    store_root: Path
    shm_dir: Path
    signals: list
    signal_at: Optional[float]
    forwarded: bool  # the engine's group got the stop signal (False when it came before the engine started)
    budget: BudgetReader
    segments: Optional[SegmentRecord]
    emit: Callable[..., None]
    _shm_before: set
    kernel: Any  # launch/kernel.py KernelCacheRun
    capture: Any  # launch/capture.py CaptureSession while capturing
    ready_at: Optional[float]
    log_dir: Path
    started_wall: float  # time.time() at the launcher's start: only files written since then are removed
    _exit_code: Optional[int] = None  # the engine's, recorded by _engine_exited; the `exit` event ends the cleanup

    def _on_signal(self, signum: int) -> None:
        """In the signal handler (signal_relay.py: nothing here may take a lock): recorded and forwarded to
        the engine's whole group at once; the main loop does the rest."""
        if not self.signals:
            self.signal_at = time.monotonic()  # the scheduler's KillWait runs from here
        self.signals.append(signum)
        if self.proc is not None and self.proc.returncode is None:
            self._forward(signum)

    def _cancel_on_signal(self, _signum: int) -> None:
        """After a stop signal, in the relay's thread: background copies stop (they take locks to do so)."""
        if self.stage_job is not None:
            self.stage_job.cancel()
        if self.capture is not None and self.capture.upload is not None:
            self.capture.upload.cancel()  # an upload from /dev/shm stops within a chunk; the capture is given up

    def _forward(self, signum: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signum)
            self.forwarded = True
        except ProcessLookupError:
            pass

    def _watchdog_deadline(self) -> float:
        """Seconds after a stop signal before launch/stop_watchdog.py rescues a stuck stop."""
        budget = self.budget.get()
        usual = sum(wait for _, wait in USUAL_STEPS)
        return deadline_after_signal(budget.seconds, budget.kill_wait, usual,
                                     margin(budget.kill_wait) if budget.kill_wait is not None else 0.0)

    def _rescue(self) -> None:
        """The watchdog's cleanup when the main thread cannot do it: the engine's group, then /dev/shm."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        free_staged(self.shm_dir)
        remove_run(self.shm_dir)
        self._report_exit()  # the cleanup that would have said it is stuck

    def _kernel_capture_budget(self, hurry: bool) -> float:
        """Seconds the kernel-cache capture may still take once the engine is gone: 30 s after the launcher's
        own stop; after a stop signal, what KillWait leaves (minus its margin), 10 s outside Slurm."""
        if not hurry:
            return 30.0
        budget = self.budget.get()
        if budget.kill_wait is None or self.signal_at is None:
            return 10.0
        return budget.kill_wait - margin(budget.kill_wait) - (time.monotonic() - self.signal_at)

    def _stop_engine(self) -> None:
        """The launcher's own stop (ready timeout, --capture-only done, cleanup): the usual sequence, cut
        short by a stop signal arriving meanwhile, which then gets the KillWait budget like any other."""
        if self.proc is None or self.proc.poll() is not None:
            return
        already = len(self.signals)
        process.stop_group(self.proc, grace=(20.0, 10.0), interrupted=lambda: len(self.signals) > already)
        if len(self.signals) > already and process.group_alive(self.proc.pid):
            self._stop_within_budget()

    def _stop_within_budget(self) -> None:
        """RAM back first — the staged files — then the engine stopped within the budget KillWait leaves."""
        assert self.proc is not None
        budget = self.budget.get()
        free_staged(self.shm_dir)
        if self.segments is not None:
            self.segments.update(force=True)
        self.emit("stopping", signal=signal.Signals(self.signals[0]).name, **budget.describe())
        process.stop_group(self.proc, steps=budget.steps(), since=self.signal_at)

    def _stop_on_signal(self) -> int:
        """After a stop signal: RAM back first — the staged files — then the engine stopped within the
        budget KillWait leaves; the rest in _cleanup. Returns the launcher's exit code."""
        assert self.proc is not None and self.segments is not None
        if not self.forwarded:  # the signal came while the engine was being started
            self._forward(self.signals[0])
        self._stop_within_budget()
        code = self.proc.poll()
        return self._engine_exited(code if code is not None else -signal.SIGKILL)

    def _engine_exited(self, code: int) -> int:
        if self.ready_at is None and not self.signals:
            tail = process.log_tail(self.log_dir / "engine.log", 20)
            self.emit("error", message=f"the engine exited with code {code} before it was ready", log_tail=tail)
        self._exit_code = code  # reported by _cleanup, last: what the cleanup still says comes before it
        return 128 - code if code < 0 else code

    def _report_exit(self) -> None:
        """The `exit` event, once: the launcher's last word (a consumer may stop reading at it)."""
        code, self._exit_code = self._exit_code, None
        if code is not None:
            self.emit("exit", code=code)

    def _cleanup(self) -> None:
        """The run's cleanup (_clean_up), then the `exit` event: no event of this launcher comes after it (a
        zygote image or kernel cache finishing in the cleanup reported after `exit` — issue 42)."""
        try:
            self._clean_up()
        finally:
            self._report_exit()

    def _clean_up(self) -> None:
        """/dev/shm first (staged files, the engine's segments, the run folder), kernel caches and the
        store after: under Slurm's KillWait what matters most goes before what can wait."""
        hurry = bool(self.signals)
        self.kernel.hold()  # no kernel capture from an engine being stopped: it waits until the engine is gone
        snapshots = getattr(self, "snapshots", None)  # a snapshot under way pauses the engine: let it end first
        if snapshots is not None:
            snapshots.abandon(wait_s=2.0 if hurry else 120.0)
        if self.proc is not None and self.proc.poll() is None:
            self._stop_engine()
        if self.proc is not None:  # anything left in the engine's process group (workers) goes too
            process.kill_group(self.proc, wait=2.0)
        if snapshots is not None:
            snapshots.reap()
        remove_rendezvous_files(rendezvous_files(self.shm_dir / "markers"), since=self.started_wall - 1.0)
        remove_engine_sockets(self.plan.spec, os.environ, since=self.started_wall - 1.0,  # its dead ipc:// files
                              wait_s=0.5 if hurry else 2.0)
        zygotes = getattr(self, "zygotes", None)  # a zygote image in the making (warmstart/zygote_starts.py)
        if zygotes is not None:
            zygotes.abandon(wait_s=1.0 if hurry else 5.0)
        if self.stage_job is not None:
            self.stage_job.cancel()
            free_staged(self.shm_dir)
            self.stage_job.finished(2.0)  # cancelled or failed: its files are gone either way
        if self.segments is not None:
            self.segments.update(force=True)
        if self.capture is not None:  # no upload may still read the run folder's capture copy while it goes
            self.capture.stop_upload(timeout=2.0 if hurry else 5.0)
        leaked = remove_orphaned_engine_shm(self._shm_before)
        remove_run(self.shm_dir)
        if leaked:
            self.emit("cleanup", message=f"removed {len(leaked)} shared-memory segment(s) the engine left in "
                                         f"/dev/shm: {', '.join(leaked)}")
        self.kernel.finish(self._kernel_capture_budget(hurry))  # what a short run compiled is still published
        if self.capture is not None:  # an unfinished capture is given up (the claim holder's leaves nothing)
            self.capture.close()
        if unpublish_run(self.plan.p2p, self.run_id, self.store_root):  # workers killed with the engine cannot
            self.emit("cleanup", message="removed this run's P2P source records")
