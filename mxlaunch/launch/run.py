"""Running a plan: the run folder and plan file, staging ∥ the engine, markers, publish, readiness, cleanup.

`Launcher.run` writes the plan file into a per-user, per-run folder in /dev/shm, starts staging this
node's ranks and the engine at the same time, frees each rank's staged files once its "loaded" marker
appears, publishes a captured snapshot once every rank has written its part (a capture through /dev/shm
uploaded into the store first, in the background once the engine is ready), watches for readiness,
and cleans up on every exit path. It returns the engine's own exit code. A stop signal frees the staged
files first and stops the engine within the scheduler's grace (shutdown.py).

Launcher is the coordinator; its mixins hold the jobs it runs beside the engine: the stage (run_stage.py:
start, watch, free, give up), the plugin's markers (run_markers.py), and the stop and cleanup (shutdown.py).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from mxlaunch import settings
from mxlaunch.contract import LOADED
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.registry import spec_engine
from mxlaunch.errors import UsageError
from mxlaunch.fileutil import mark_used, process_start_time, write_json_atomic
from mxlaunch.launch import port, process
from mxlaunch.warmstart.zygote_starts import ZygoteStarts
from mxlaunch.warmstart import lean_snapshot
from mxlaunch.warmstart.engine_snapshots import EngineSnapshots
from mxlaunch.launch.capture import CaptureSession
from mxlaunch.launch.cleanup import SegmentRecord, reap_all_stale_runs, shm_entries, user_root
from mxlaunch.launch.decide import LaunchOptions, LaunchPlan, _rank_rel
from mxlaunch.launch.kernel import KernelCacheRun
from mxlaunch.kernelcache.archive import KernelCacheStore
from mxlaunch.launch.process import default_log_root
from mxlaunch.launch.run_markers import Markers, clear_markers
from mxlaunch.launch.run_stage import Staging
from mxlaunch.safety.ownership import own_dir
from mxlaunch.signal_relay import SignalRelay
from mxlaunch.launch.shutdown import BudgetReader, Stopping
from mxlaunch.launch.stop_watchdog import StopWatchdog
from mxlaunch.safety.logfile import open_log
from mxlaunch.plan import PLAN_ENV, Plan, RankFile
from mxlaunch.safety.redact import Scrubber, redact_text, redact_url, secret_values
from mxlaunch.store.core import Store
from mxlaunch.store.opener import open_store


class Launcher(Staging, Markers, Stopping):
    """Runs one LaunchPlan in the foreground. `emit(event, **fields)` reports progress."""

    def __init__(self, plan: LaunchPlan, opts: LaunchOptions, emit: Callable[..., None],
                 echo: Callable[[str], None], store: Optional[Store] = None, *, watchdog: bool = False) -> None:
        """watchdog: rescue a stuck stop by exiting this process (launch/stop_watchdog.py) — for the CLI,
        where the launcher is the process; never for a Launcher embedded in another program."""
        self.plan = plan
        self.watchdog = watchdog
        self.opts = opts
        self.emit = emit
        self.echo = echo
        self.store = store
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            self.run_id = f"job{job}-{self.run_id}"
        shm_root, self.shm_root_why = user_root()  # this uid's own folder in /dev/shm, or its private fallback
        self.shm_dir = shm_root / self.run_id
        self.log_dir = Path(opts.run_dir) if opts.run_dir else default_log_root() / self.run_id
        self.proc: Optional[subprocess.Popen] = None  # or a zygote.ZygoteChild (--zygote), driven the same way
        self.stage_job = None
        self.capture: Optional[CaptureSession] = None
        self.stop_reason: Optional[str] = None
        self.signals: list[int] = []
        self.signal_at: Optional[float] = None
        self.forwarded = False
        self.budget = BudgetReader()  # KillWait, read in the background (scontrol) while the engine starts
        self.segments: Optional[SegmentRecord] = None
        self.ready_at: Optional[float] = None
        self.bind_failure: Optional[str] = None  # the engine's HTTP server could not bind its port (launch/port.py)
        self.t0 = time.monotonic()
        self.started_wall = time.time()
        self.loaded: set[int] = set()
        self.stage_result = None
        self.stage_error: Optional[str] = None
        self.kept_bytes = 0  # --keep-staged: bytes the last launch kept in /dev/shm, linked instead of read
        self._profile_lock = threading.Lock()
        self._shm_before: set[str] = set()
        kc = store or open_store(opts.artifact_path)  # JIT kernel caches: restored before the engine, captured after ready
        self.kernel = KernelCacheRun(plan.kernel_cache, KernelCacheStore(kc.root, kc.coordinator), emit, model=plan.spec.model)
        self.store_root = kc.root
        self.zygotes = ZygoteStarts(plan, opts, self.store_root, self.log_dir, emit, stage_root=self.shm_dir)  # --zygote (warmstart/zygote_starts.py)
        self.snapshots = EngineSnapshots(opts.engine_snapshot, list(plan.spec.argv), plan.source_id, self.shm_dir,
                                         self.log_dir, emit, p2p=plan.p2p is not None,  # --engine-snapshot
                                         store_root=None if getattr(kc, "remote", False) else kc.root)
        from mxlaunch.profile.profiler import StartupProfiler

        self.profiler = StartupProfiler(engine=plan.spec.engine, source="engine.log", live=True)

    # -- setup --

    def _prepare(self) -> Plan:
        for stale, segments in reap_all_stale_runs():
            more = f" and the {len(segments)} segment(s) it recorded: {', '.join(segments)}" if segments else ""
            self.emit("cleanup", message=f"removed a stale run folder {stale}{more}")
        if self.shm_root_why:  # another user took /dev/shm/mxlaunch-<uid> first: this run uses a private name instead
            self.emit("shm-folder", path=str(self.shm_dir.parent),
                      message=f"{self.shm_root_why}; this run's folder is in {self.shm_dir.parent} instead (this "
                              "user's alone) — to get the usual name back, ask its owner or root to remove it")
        os.mkdir(self.shm_dir, 0o700)  # in a folder of this user's alone (cleanup.user_root): nobody can swap it
        own_dir(self.shm_dir / "markers")  # made here, private: the plugin writes its markers into it
        write_json_atomic(self.shm_dir / "owner.json",
                          {"pid": os.getpid(), "start_time": process_start_time(os.getpid())}, private=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        plan = Plan(strategy=self.plan.strategy, source_id=self.plan.source_id, run_dir=str(self.shm_dir),
                    wait_timeout_s=self.opts.ready_timeout, snapshot_format=self.plan.snapshot_format,
                    p2p=self.plan.p2p.block(self.run_id) if self.plan.p2p else None)
        if self.plan.strategy == "capture":
            self.store = self.store or open_store(self.opts.artifact_path)
            via_shm = self.plan.capture_via == "shm"  # make_plan decided (launch/capture_route.py)
            # an S3 store takes no writes in place: without room in /dev/shm the capture goes to a node-local spool
            self.capture = CaptureSession(self.store, self.plan, self.emit,
                                          local_root=self.shm_dir / "capture" if via_shm else self.store.capture_spool(self.run_id),
                                          upload_at_once=self.opts.capture_only,
                                          keep_root=self.shm_dir.parent if self.opts.keep_staged and via_shm else None)
            why_not = self.capture.start()
            if why_not is not None:
                self.capture = None
                self._downgrade(why_not)
                return self._prepare_default(plan)
            plan.capture_dir, plan.capture_ranks = self.capture.plan_fields()
            self.emit("capture-via", via=self.plan.capture_via or "store", bytes=self.plan.capture_bytes,
                      message=self.plan.capture_via_reason or "the capture is written straight into the store")
        elif self.plan.strategy == "staged":
            # Files are staged once per snapshot rank; every local worker (its global rank, as the plugin
            # sees it) is pointed at its snapshot rank's files — DP replicas share them.
            stage_root = self.shm_dir / "stage"
            by_snapshot: dict[int, list[RankFile]] = {}
            for f in self.plan.stage_files:
                rank, rel = _rank_rel(f.path)
                by_snapshot.setdefault(rank, []).append(RankFile(path=str(stage_root / str(rank) / rel), bytes=f.bytes))
            for worker in self.plan.local_ranks:
                plan.ranks[str(worker["rank"])] = by_snapshot.get(worker["snapshot_rank"], [])
        write_json_atomic(self.shm_dir / "plan.json", plan.to_dict(), private=True)  # the plugin refuses any other
        return plan

    def _prepare_default(self, plan: Plan) -> Plan:
        plan.strategy = "default"
        write_json_atomic(self.shm_dir / "plan.json", plan.to_dict(), private=True)  # the plugin refuses any other
        return plan

    def _downgrade(self, reason: str) -> None:
        self.plan.strategy = "default"
        self.plan.reason = reason
        self.plan.capture_via, self.plan.capture_via_reason, self.plan.capture_bytes = None, "", 0
        self.plan.argv = list(self.plan.spec.argv)
        self.emit("fallback", reason=reason)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[PLAN_ENV] = str(self.shm_dir / "plan.json")
        start = self.plan.engine_start
        for key, value in (start.env if start else {}).items():  # the engine's start-up cuts (launch/engine_start.py)
            env.setdefault(key, value)
        if self.plan.p2p and redact_url(self.plan.p2p.registry) != self.plan.p2p.registry:
            env[settings.REGISTRY] = self.plan.p2p.registry  # the plan file shows it redacted (plan.registry_url)
        allowlist = spec_engine(self.plan.spec).plugin_allowlist
        if env.get(allowlist):  # an allowlist that leaves mxlaunch out would silently disable the plugin
            names = env[allowlist].split(",")
            if "mxlaunch" not in names:
                env[allowlist] = ",".join(names + ["mxlaunch"])
        return env

    # -- the run --

    def run(self) -> int:
        code = 1
        relay = SignalRelay((signal.SIGINT, signal.SIGTERM), immediate=self._on_signal,
                            deferred=self._cancel_on_signal).__enter__()
        watchdog = StopWatchdog(self._watchdog_deadline, self._rescue) if self.watchdog else None
        if watchdog is not None:
            watchdog.start()
        try:
            if serves_http(self.plan.spec) and self.plan.spec.port:  # before anything is staged or started
                port.check_free(self.plan.spec.host, self.plan.spec.port)
            self._shm_before = shm_entries()  # before a restore: the files it puts back are the run's to remove
            # A lean snapshot refills from the stage: staging starts first, so the weights land while CRIU
            # restores the processes (on the H200 the two ran one after the other: 4-5 s, then 5 s).
            staged_first, image_s = self.snapshots.lean_ahead(self.plan.strategy), 0.0
            if staged_first:
                self._prepare()
                # the image first (CRIU needs all of it), leaving room for the weights staged after it
                began = time.monotonic()
                self.snapshots.stage_image_ahead(self.plan.strategy, self._stage_bytes_to_read())
                image_s = time.monotonic() - began
                self._start_stage_or_fall_back()
            # none when stopping already, or when the stage a lean restore would refill from could not start
            began = time.monotonic()
            restored = None if self.signals or self.stage_error else self.snapshots.try_restore(self.plan.strategy)
            if restored is not None:  # its own phase in the ready event, not a slow interpreter_startup
                self.profiler.launcher_phase("image_restore", image_s + time.monotonic() - began)
            self.snapshots.drop_ahead()
            if restored is not None and restored.meta.get("lean"):  # its weights come from the stage (lean_snapshot.py)
                self.plan.reason = "restored this command's lean engine snapshot: no engine start; its weights " \
                                   "refilled from the staged snapshot"
            elif restored is not None:
                self.plan.strategy = "snapshot"
                self.plan.reason = "restored this command's engine snapshot: no engine start, no weights to load"
            if not staged_first:
                self._prepare()
            if restored is None:  # a dumpable start on a GPU: the flags that let it sleep (warmstart/engine_snapshots.py)
                engine = spec_engine(self.plan.spec)
                self.plan.argv += self.snapshots.engine_args(engine.snapshot_sleep_flags, self.plan.argv,
                                                             engine.snapshot_refill_extension,
                                                             lambda: lean_snapshot.blocker(self.store or open_store(self.opts.artifact_path)))
            argv = self.plan.argv
            self.emit("plan", strategy=self.plan.strategy, reason=self.plan.reason, source_id=self.plan.source_id,
                      snapshot_format=self.plan.snapshot_format, argv=argv, run_dir=str(self.shm_dir), log=str(self.log_dir / "engine.log"),
                      capture_via=self.plan.capture_via, capture_via_reason=self.plan.capture_via_reason,
                      engine_start=self.plan.engine_start.to_json() if self.plan.engine_start else None)
            self.segments = SegmentRecord(self.shm_dir, self._shm_before)
            if self.signals:  # stopped before the engine started (a restored one was not ours to serve yet)
                if restored is not None:
                    restored.kill_tree()
                return 128 + self.signals[0]
            env = {**self._env(), **self.snapshots.env(), **(self.kernel.restore() if restored is None else self.kernel.skip(
                "the engine was restored from its snapshot: it compiles nothing in this run, so no kernel cache is "
                "restored or captured"))}
            log = open_log(self.log_dir / "engine.log")  # 0600, O_NOFOLLOW (safety/logfile.py)
            # The engine first, then staging: the engine needs the files only once it has built the model
            # (tens of seconds later), while the stage's reader threads, started first, held the GIL against
            # the kernel-cache restore and the spawn (0.7-0.8 s before the engine's first line on the 2-core VM).
            try:
                dumpable = self.snapshots.dumpable  # a zygote's children are not ours to snapshot
                self.proc = restored or (None if dumpable else self.zygotes.fork(argv, env)) or \
                    process.start(argv, env, dumpable=dumpable)
            except OSError as exc:  # checked in the plan already; a PATH changed since, or a race
                raise UsageError(f"cannot start the engine command {argv[0]}: {exc.strerror or exc}",
                                 "check the command after --, or activate the environment that has the engine")
            if not staged_first:
                self._start_stage_or_fall_back()
            if self.plan.strategy in ("staged", "p2p"):  # `store prune` removes the least recently used first
                mark_used(self.store_root / self.plan.source_id)
            began = time.monotonic()
            if restored is not None and not self.snapshots.refill(self.shm_dir / "plan.json"):
                # the lean restore failed: start as usual, from the stage — a rank the refill marked loaded
                # would have its staged files freed under the new engine
                clear_markers(self.shm_dir / "markers", LOADED)
                self.proc = process.start(argv, env, dumpable=False)
            elif restored is not None and restored.meta.get("lean"):
                self.profiler.launcher_phase("refill", time.monotonic() - began)
            if self.zygotes.image_restore_s is not None:
                self.profiler.launcher_phase("image_restore", self.zygotes.image_restore_s)
            reader = threading.Thread(target=self._pump, args=(self.proc, log), daemon=True)
            reader.start()
            code = self._supervise()
            reader.join(timeout=5)
            log.close()
            return code
        finally:
            relay.__exit__(None, None, None)
            self._cleanup()
            if watchdog is not None:
                watchdog.finished()

    def _feed_profile(self, line: str, arrival: Optional[float] = None) -> None:
        with self._profile_lock:
            self.profiler.feed(line, arrival=time.monotonic() - self.t0 if arrival is None else arrival)
        self.kernel.tally.feed(line)

    def _pump(self, proc: subprocess.Popen, log: Any) -> None:
        """The engine's output: raw bytes to engine.log, each line (\n or \r) echoed and profiled."""
        assert proc.stdout is not None
        known = self._secrets()
        scrub = Scrubber(known)  # the launch's secrets, wherever the engine prints them (SGLang: its server_args)

        def chunk(data: bytes) -> None:
            log.write(scrub.feed(data))
            log.flush()

        def line(text: str, arrival: float) -> None:
            self.echo(redact_text(text, known))
            self._feed_profile(text, arrival)
            if self.ready_at is None and self.plan.spec.port and self.bind_failure is None:
                self.bind_failure = port.bind_failure(text, self.plan.spec.port)

        process.read_lines(proc.stdout.fileno(), line, self.t0, on_chunk=chunk)
        log.write(scrub.end())
        log.flush()

    def _secrets(self) -> frozenset[str]:
        """The values of this launch's secrets (argv, registry URL, environment): kept out of what it prints."""
        urls = [self.opts.registry, self.plan.p2p.registry if self.plan.p2p else None]
        return secret_values(self.plan.argv, os.environ, urls)

    def _supervise(self) -> int:
        assert self.proc is not None
        url = f"http://{_client_host(self.plan.spec.host)}:{self.plan.spec.port or 8000}/health"
        deadline = self.t0 + self.opts.ready_timeout
        client = httpx.Client(timeout=2.0)
        http = serves_http(self.plan.spec)
        if not http:
            self.emit("worker-node", message=f"node {self.plan.spec.node_rank} of {self.plan.spec.nnodes} runs workers "
                                             "only (no HTTP server): serving until the engine exits")
        try:
            while True:
                if self.signals:
                    return self._stop_on_signal()
                assert self.segments is not None
                self.segments.update()
                code = self.proc.poll()
                self._check_markers()
                if code is not None:
                    return self._engine_exited(code)
                if self.bind_failure is not None and self.ready_at is None:  # SGLang hangs after it: stop it now
                    self.stop_reason = self.bind_failure
                    self.emit("error", message=f"{self.bind_failure} — another process took the port after "
                                               "mxlaunch checked it; stop it or pass the engine another --port")
                    self._stop_engine()
                    return 1
                if self.ready_at is None and http:
                    if _healthy(client, url):
                        self.ready_at = time.monotonic()
                        self._report_ready()
                    elif time.monotonic() > deadline:
                        self.stop_reason = f"not ready after {self.opts.ready_timeout:.0f} s"
                        self.emit("error", message=self.stop_reason)
                        self._stop_engine()
                        return 1
                if self.opts.capture_only and self.published:
                    self.emit("capture-only", message="snapshot published; stopping the engine")
                    self._stop_engine()
                    self.proc.wait()
                    return 0
                if self.opts.capture_only and (self.capture is None or self.capture.failed):  # downgraded, fell back, gave up
                    self.emit("error", message="--capture-only: this run will not publish a snapshot (see the fallback "
                                               "or error above); stopping the engine")
                    self._stop_engine()
                    self.proc.wait()
                    return 1
                time.sleep(0.25)
        finally:
            client.close()

    def _snapshot_ready(self) -> Optional[bool]:
        """Snapshot the engine now (True), never (False: its capture failed), or not yet (None)."""
        if self.capture is None or self.capture.published:
            return True
        return False if self.capture.failed else None

    def _store_refill_plan(self) -> str:
        """The plan a lean snapshot's serving engine refills from (warmstart/lean_snapshot.py): its path."""
        return lean_snapshot.write_store_plan(self.store or open_store(self.opts.artifact_path), self.plan,
                                              self.shm_dir, self.opts.ready_timeout)

    @property
    def published(self) -> bool:
        return self.capture is not None and self.capture.published

    def _report_ready(self) -> None:
        seconds = self.ready_at - self.t0
        with self._profile_lock:
            timeline = self.profiler.result()
        phases = {p.name: round(p.seconds, 3) for p in timeline.phases}
        self.kernel.judge_ready()
        self.emit("ready", seconds=round(seconds, 3), strategy=self.plan.strategy, phases=phases, kernel_cache=self.kernel.status)
        self.kernel.start_capture()
        self.zygotes.start_next()
        if self.proc is not None:
            self.snapshots.start_maker(self.proc.pid, self._snapshot_ready, self._store_refill_plan)
        if self.capture is not None:  # a capture through /dev/shm uploads into the store from now on
            self.capture.engine_ready()
        self.timeline = timeline


def serves_http(spec: LaunchSpec) -> bool:
    """False on the worker nodes of a multi-node run: they never answer /health, so readiness is not
    awaited there and the ready timeout does not apply."""
    return spec_engine(spec).serves_http(spec)


def _client_host(host: Optional[str]) -> str:
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False
