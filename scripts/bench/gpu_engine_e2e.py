#!/usr/bin/env python3
"""The real engine on the GPU, through mxlaunch: every strategy checked with `mxlaunch verify`, time to ready
measured from spawn. Run on the GPU machine once vLLM 0.26's CUDA kit is there (the development workspace's gpu-engines/README.md):

    source /tmp/kit/device_env.sh && python3 scripts/bench/gpu_engine_e2e.py \
        --scenarios default,capture,staged,staged --out $OUT/gpu_engine.json
    # a later run of the same machine adds to the same work folder's record:
    source /tmp/kit/device_env.sh && python3 scripts/bench/gpu_engine_e2e.py \
        --scenarios default,prefetch,fastsafetensors,staged,p2p --out $OUT/gpu_engine.json

One run per batch of scenarios, in the order given; the work folder (default /tmp/gpu-e2e) keeps the model,
the gold, the store and the runs so far, so a batch can build on the one before (`staged` needs a
`capture` first, every comparison needs a `default` first: its `mxlaunch verify --record` is the gold).

Scenarios (each one start, vLLM `python3 -m vllm.entrypoints.openai.api_server`, bf16, `--enforce-eager`):
  default          the engine alone (the first one records the gold)
  capture          `mxlaunch launch` into an empty store: the first serve captures (waits for "published")
  staged           `mxlaunch launch --no-p2p` from the store (the staged restore; the engine core forked)
  staged-spawn     the same with `--no-engine-fork` (vLLM's CLI start method: the engine core spawned)
  default-fork     the engine alone with VLLM_WORKER_MULTIPROC_METHOD=fork (the fork without mxlaunch)
  zygote           a restart: one staged start with `--zygote` (it starts a warm interpreter once ready),
                   then the recorded one, forked from that interpreter; the zygote is stopped after
  zygote-image     a node's first start: one staged start with `--zygote` leaves a zygote and, once it has
                   imported, its CRIU image in the store (MXLAUNCH_CRIU: the kit of scripts/kits/build_criu_kit.sh);
                   the zygote is stopped, and the recorded start restores it from the image and forks
  p2p              a staged source with P2P on, then a second server on the same GPU pulling from it over
                   NIXL (each with half the --gpu-memory-utilization); the record is the puller's
  prefetch         vLLM `--safetensors-load-strategy prefetch`
  fastsafetensors  vLLM `--load-format fastsafetensors` (recorded "not installed" if it cannot import)
  instanttensor    vLLM `--load-format instanttensor` (likewise)
  engine-snapshot  `mxlaunch launch --engine-snapshot` twice: the first start serves and snapshots its engine
                   (asleep with MXLAUNCH_SNAPSHOT_SLEEP=1: no KV cache in the image), then serves on; the second
                   restores it (its `ready_s` is /health's; the launcher's ready event comes once the GPU state is
                   restored and the engine awake: `launcher_ready`). Without a
                   `default` before it, the first start's answers after its snapshot are the gold

Before every start the pages of the model's and the store's files are evicted (posix_fadvise DONTNEED);
the software (Python, vLLM, CUDA) stays warm. Per start: `ready_s` (spawn → /health 200), `weight_s` (the
weight phase from the engine's log: vLLM's "Loading weights took", mxlaunch's "rank 0 loaded"),
`first_line_s` (spawn → the first line the process printed: the interpreter and its imports) and
`engine_core_s` (spawn → the engine core process's first line), the launcher's or the log's phases, and
`verify` ("exact", or what differed). VLLM_USE_FLASHINFER_SAMPLER=0 for every start (the same for all):
a fresh node would otherwise spend ~117 s in a silent FlashInfer JIT build in the first one
(`--flashinfer-sampler` leaves vLLM's default: that build is then part of every fresh-node start).

`--compile` drops `--enforce-eager` (vLLM's default: torch.compile and CUDA graphs); `--fresh-node` removes
this machine's JIT kernel caches before every start (vLLM's, Inductor's, Triton's, FlashInfer's, and the
launcher's local copies), keeping the store: every start is a node that never ran the model, and only
mxlaunch's kernel cache (captured into the store by `capture`) can bring the compiled kernels back:

    source /tmp/kit/device_env.sh && python3 scripts/bench/gpu_engine_e2e.py --compile --fresh-node \
        --scenarios default,capture,staged,staged --work /tmp/gpu-e2e-compile --out $OUT/gpu_compile.json

Quantized (issue 40, docs/quantized.md): `--quant fp8-online|w8a8-fp8|w8a8-int8|awq|gptq|block-fp8` serves the
Llama quantized (block-fp8: DeepSeek-V3's 128×128 block FP8, DeepGEMM on Hopper), `--moe` a Mixtral made from it
(8 experts, top 2; `--moe --quant w8a8-fp8`: compressed-tensors FP8 MoE), `--quant-out` adds one record per start
(method, strategy, verify, fallback, weight_s, the kernels vLLM chose; p2p: the source's strategy and the
transport; after an exact second `default`, the ratio of ready to the engine alone). `--models` keeps the
generated models in one folder for every `--work`:

    source /tmp/kit/device_env.sh && python3 scripts/bench/gpu_engine_e2e.py --quant block-fp8 \
        --scenarios default,default,capture --models /tmp/gpu-models --work /tmp/gpu-e2e-bfp8 \
        --out $OUT/gpu_bfp8.json --quant-out $OUT/quantized.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launch_runs import REPO, Option, _stop, free_port, read_log  # noqa: E402

API = "vllm.entrypoints.openai.api_server"
# --engine sglang: SGLang 0.5.16's kit (docs/sglang-gpu.md) has no FA3, so its attention is FlashInfer's
ENGINE = {"name": "vllm", "attention": "flashinfer"}
# --sglang-args: flags appended to every SGLang start (a CPU dry run of the harness: docs/sglang-gpu.md)
SGLANG_EXTRA: list[str] = []
# what --engine sglang runs: SGLang has no sleep wired into mxlaunch (no lean snapshot) and no zygote; its P2P pull
# is the launcher's own (plugin/p2p.py: CUDA IPC on one host, else NIXL), as for vLLM
SGLANG_SCENARIOS = ("default", "capture", "staged", "staged-spawn", "p2p", "engine-snapshot")
# the engine core's (vLLM) or the TP-0 scheduler's (SGLang) first line: the second process is up
CORE_MARK = {"vllm": "EngineCore", "sglang": "TP0"}
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1"}
ENGINE_OPTIONS = {"prefetch": ("--safetensors-load-strategy", "prefetch"),
                  "fastsafetensors": ("--load-format", "fastsafetensors"),
                  "instanttensor": ("--load-format", "instanttensor")}
# the engine's start-up (issue 24): the same weight path with and without the launcher's start-up cuts
FORK_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
SCENARIOS = ("default", "default-fork", "capture", "staged", "staged-spawn", "zygote", "zygote-image", "zygote-image-newenv",
             "p2p", "engine-snapshot", "engine-snapshot-lean", *ENGINE_OPTIONS)
# a Slurm job's environment: zygote-image-newenv starts its second launch as the next job on another node would
JOB_ENV = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NODELIST", "SLURMD_NODENAME", "SLURM_STEP_ID", "HOSTNAME", "TMPDIR")
LAUNCHED = ("capture", "staged", "staged-spawn", "zygote", "zygote-image")
# what vLLM's log says of its own compile work (seconds), per start
LOG_TIMES = {"torch_compile_s": r"torch\.compile takes ([0-9.]+) s in total",
             "compiled_graph_load_s": r"Directly load the compiled graph\(s\).*?took ([0-9.]+) s",
             "graph_capture_s": r"Graph capturing finished in ([0-9.]+) secs",
             "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"}
MODES = {"default": "engine alone (vLLM CLI: engine core spawned)", "default-fork": "engine alone, engine core forked",
         "staged": "mxlaunch staged, engine core forked", "staged-spawn": "mxlaunch staged, engine core spawned",
         "zygote": "mxlaunch staged, forked from a zygote, engine core forked",
         "zygote-image": "mxlaunch staged, no zygote waiting: the zygote restored from its CRIU image, then forked",
         "zygote-image-newenv": "mxlaunch staged, a new job's environment (new SLURM_* ids, HOSTNAME, TMPDIR): the zygote "
                                "restored from the previous job's CRIU image, then forked",
         "engine-snapshot": "mxlaunch --engine-snapshot: the second start restores the first one's engine (CUDA checkpoint + CRIU)",
         "engine-snapshot-lean": "mxlaunch --engine-snapshot, MXLAUNCH_SNAPSHOT_SLEEP=lean: the image holds no weights and no "
                                 "KV cache; the second start restores it and refills the weights from the staged snapshot"}


class Cut(BaseException):  # not an Exception: no broad `except Exception` on the way may swallow it
    """SIGTERM (`timeout`, the device tool's limit) reached the harness: the start under way is stopped by its
    `finally` — its engine runs in a session of its own, so the signal never reaches it, and an engine left running
    holds the GPU's memory for the next run (session 31: "Free memory on device (22.36/79.18 GiB)")."""


def _cut(signum: int, _frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # once: a second signal must not interrupt the engine's stop
    raise Cut(f"cut by signal {signum} before it finished (its engine was stopped)")


def evict(*folders: Path) -> int:
    """Drop the page cache of every regular file under the folders; returns the bytes evicted."""
    total = 0
    for folder in folders:
        for path in folder.rglob("*") if folder.is_dir() else []:
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    total += os.fstat(fd).st_size
                finally:
                    os.close(fd)
    return total


RECORD_EACH = {"on": False}  # --record-each: every start's answers are kept (a gold file each)
COMPILE = {"on": False}  # --compile: vLLM's default torch.compile + CUDA graphs (no --enforce-eager)
# --quant METHOD (issue 40): every start of the batch serves the model quantized. fp8-online: the bf16 Llama with
# vLLM's `--quantization fp8`; the others: a checkpoint written from it by tests/helpers/quantized_model.py
QUANT = {"method": None, "extra": (), "name": None}  # name: --quant as given (method: what records say)
# block-fp8: DeepSeek-V3's 128×128 block FP8 (vLLM 0.26 on Hopper: DeepGEMM's JIT); nvfp4 / modelopt-nvfp4: W4A4
# NVFP4 as compressed-tensors / ModelOpt write it (Hopper has no FP4 GEMM: vLLM takes a W4A16 or emulation kernel);
# mxfp4: compressed-tensors' OCP MXFP4 (E8M0 scales per 32; Marlin's W4A16 on Hopper)
# gptq-act-order: GPTQ with desc_act (vLLM 0.26's Marlin sorts g_idx after loading; vLLM ≥ 0.32 refuses it)
# w8a8-int8-kvfp8: W8A8 INT8 with per-tensor fp8 KV-cache scales (k_scale/v_scale), served --kv-cache-dtype fp8
QUANT_METHODS = {"fp8-online": ("--quantization", "fp8"), "w8a8-fp8": (), "w8a8-int8": (), "awq": (), "gptq": (),
                 "gptq-act-order": (), "block-fp8": (), "nvfp4": (), "modelopt-nvfp4": (), "modelopt-fp8": (), "mxfp4": (),
                 "w8a8-int8-kvfp8": ("--kv-cache-dtype", "fp8")}
# the same methods' flags in SGLang's spelling (every other method is read from the checkpoint's config.json)
SGLANG_QUANT_FLAGS = {"fp8-online": ("--quantization", "fp8"), "w8a8-int8-kvfp8": ("--kv-cache-dtype", "fp8_e4m3")}


def quant_model(base: Path, models: Path, size: str, method: Optional[str], moe: bool) -> tuple[Path, Optional[str]]:
    """The model a --quant/--moe batch serves, written once into `models` from the generated Llama `base`, and
    the method name its records carry. moe: a Mixtral (tests/helpers/quantized_model.py GPU_MOE: 8 experts,
    top 2) with the Llama's tokenizer, quantized by `method` (w8a8-fp8: compressed-tensors per-channel FP8 —
    vLLM's CompressedTensorsW8A8Fp8MoEMethod)."""
    if not moe and method in (None, "fp8-online"):
        return base, method
    sys.path.insert(0, str(REPO))
    from tests.helpers.quantized_model import GPU_MOE, mixtral_from_llama, quantize_model  # noqa: PLC0415 — torch

    def made(path: Path, write: Any) -> Path:
        if not (path / "config.json").exists():
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            write(tmp)
            tmp.rename(path)
        return path

    if moe:
        base = made(models / f"mixtral-from-{size}", lambda out: mixtral_from_llama(base, out, **GPU_MOE))
    if method in (None, "fp8-online"):
        return base, f"{method or 'bf16'}-moe" if moe else method
    quantized = made(models / f"{base.name}-{method}", lambda out: quantize_model(base, out, method))
    return quantized, f"{method}-moe" if moe else method


def jit_cache_dirs() -> list[Path]:
    """This machine's JIT kernel caches (vLLM's torch.compile cache, Inductor, Triton, FlashInfer) and the
    launcher's local copies of the store's kernel caches: what a node that never ran the model lacks."""
    home, user = Path.home(), os.environ.get("USER") or str(os.getuid())
    return [home / ".cache" / "vllm", home / ".cache" / "mxlaunch" / "kernel-cache", home / ".triton",
            home / ".cache" / "flashinfer", home / ".cache" / "tvm-ffi", home / ".nv" / "ComputeCache",
            Path(tempfile.gettempdir()) / f"torchinductor_{user}",
            Path(tempfile.gettempdir()) / "torchinductor_root"]


def shown(path: Path | str) -> str:
    """A path for the record without this machine's home folder in it."""
    home, text = str(Path.home()), str(path)
    return "~" if text == home else text.replace(home + "/", "~/")


def shown_argv(argv: list[str]) -> str:
    """A command for the record: the interpreter as `python3`, the home folder as `~`."""
    return shown(shlex.join(["python3" if a == sys.executable else a for a in argv]))


def wipe_node() -> list[str]:
    """What a node that never ran the model lacks, removed: the JIT caches, the node-local engine snapshots,
    this user's run and zygote folders in /dev/shm, and the page cache (the store stays)."""
    gone = wipe_jit_caches()
    local = Path.home() / ".cache" / "mxlaunch" / "engine-snapshots"
    shm = [p for p in Path("/dev/shm").glob(f"mxlaunch*{os.getuid()}*")]
    for path in [local, *shm]:
        if path.exists():
            gone.append(shown(path))
            shutil.rmtree(path, ignore_errors=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        gone.append("page cache")
    except OSError:
        pass
    return gone


def wipe_jit_caches() -> list[str]:
    """--fresh-node: every start as on a node that never ran the model (the store stays)."""
    gone = [shown(d) for d in jit_cache_dirs() if d.exists()]
    for d in jit_cache_dirs():
        shutil.rmtree(d, ignore_errors=True)
    return gone


def autotune_choices() -> dict[str, str]:
    """Inductor's run-time autotuning results (`<kernel hash>.best_config`: the Triton launch config it timed
    fastest) in every JIT cache: a reduction's block sizes fix its summation order, so two fresh compiles that
    chose differently serve different numbers. Compared start by start to tell timing from configuration."""
    found: dict[str, str] = {}
    for folder in jit_cache_dirs():
        for path in folder.rglob("*.best_config") if folder.is_dir() else []:
            try:
                found[path.stem] = path.read_text()
            except OSError:
                continue
    return found


def engine_argv(model: Path, port: int, util: float, extra: tuple[str, ...] = ()) -> list[str]:
    if ENGINE["name"] == "sglang":
        graphs = () if COMPILE["on"] else ("--disable-cuda-graph",)
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--dtype", "bfloat16", *graphs,
                "--context-length", "2048", "--mem-fraction-static", f"{util:g}", "--attention-backend", ENGINE["attention"],
                "--sampling-backend", "pytorch", "--host", "127.0.0.1", "--port", str(port),
                *SGLANG_QUANT_FLAGS.get(QUANT["name"] or "", ()), *extra, *SGLANG_EXTRA]
    eager = () if COMPILE["on"] else ("--enforce-eager",)
    return [sys.executable, "-m", API, "--model", str(model), "--dtype", "bfloat16", *eager,
            "--max-model-len", "2048", "--gpu-memory-utilization", f"{util:g}", "--host", "127.0.0.1",
            "--port", str(port), *QUANT["extra"], *extra]


class Start:
    """One process (a plain engine or `mxlaunch launch`) and the arrival times of its lines."""

    def __init__(self, argv: list[str], log: Path, events: Optional[Path], env: Optional[dict] = None) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **ENV, **(env or {})},
                                     start_new_session=True, cwd=REPO, stdin=subprocess.DEVNULL)
        self.log, self.events_path = log, events
        self.first_line_s: Optional[float] = None
        self.engine_core_s: Optional[float] = None
        self.events: list[dict] = []
        self._lock = threading.Lock()
        sinks = [(self.proc.stderr, open(log, "wb"), False)]
        sinks.append((self.proc.stdout, open(events, "wb") if events else sinks[0][1], events is not None))
        self.threads = [threading.Thread(target=self._pump, args=s, daemon=True) for s in sinks]
        for t in self.threads:
            t.start()

    def _pump(self, pipe: Any, sink: Any, json_lines: bool) -> None:
        for raw in iter(pipe.readline, b""):
            now = round(time.monotonic() - self.t0, 3)
            with self._lock:
                sink.write(raw)
                sink.flush()
                text = raw.decode(errors="replace")
                if json_lines:
                    try:
                        self.events.append(json.loads(text))
                    except ValueError:
                        pass
                    continue
                if self.first_line_s is None and not text.startswith(("{", "mxlaunch")):  # the engine's, not ours
                    self.first_line_s = now
                if self.engine_core_s is None and CORE_MARK[ENGINE["name"]] in text:
                    self.engine_core_s = now

    def event(self, name: str) -> Optional[dict]:
        with self._lock:
            return next((e for e in self.events if e.get("event") == name), None)

    def wait_ready(self, port: int, timeout: float) -> float:
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode} before it was ready")
            try:
                # SGLang's /health runs a one-token generation: on a busy CPU (the dry run) it can take seconds
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200:
                    return round(time.monotonic() - self.t0, 3)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"not ready in {timeout:g} s")

    def wait_event(self, name: str, timeout: float) -> Optional[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.event(name)
            if found or self.proc.poll() is not None:
                return found
            time.sleep(0.2)
        return None

    def stop(self, launcher: bool) -> None:
        _stop(self.proc, launcher=launcher)
        for t in self.threads:
            t.join(5)


def mx(*args: str) -> list[str]:
    return [sys.executable, "-m", "mxlaunch.cli", *args]


def verify(port: int, gold: Path, record: bool) -> str:
    """Record the gold, or compare against it: "exact", or what differed."""
    flag = "--record" if record else "--compare"
    proc = subprocess.run(mx("verify", "--url", f"http://127.0.0.1:{port}", flag, str(gold), "--json"),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    if record:
        return "gold" if proc.returncode == 0 else f"record failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return f"compare failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"
    if report.get("pass"):
        return "exact"
    return f"{report.get('prompts_failed')} prompts differ; worst {report.get('worst')}"


def profile_phases(log: Path) -> dict:
    proc = subprocess.run(mx("profile", "--log", str(log), "--json"), capture_output=True, text=True, timeout=120, cwd=REPO)
    try:
        run = json.loads(proc.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        return {}
    return {p["name"]: p.get("seconds") for p in run.get("phases", [])}


def importable(module: str) -> Optional[str]:
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


class Harness:
    def __init__(self, work: Path, model: Path, util: float, timeout: float) -> None:
        self.work, self.model, self.util, self.timeout = work, model, util, timeout
        self.store, self.gold, self.logs = work / "store", work / "gold.json", work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.record_path = work / "runs.json"
        self.fresh_node = False
        self.runs: list[dict] = json.loads(self.record_path.read_text()) if self.record_path.exists() else []

    def _log(self, name: str) -> Path:
        return self.logs / f"{len(self.runs):02d}-{name}.log"

    def run(self, scenario: str) -> dict:
        wiped = wipe_jit_caches() if self.fresh_node else None
        evicted = evict(self.model, self.store)
        try:
            if scenario == "p2p":
                rec = self._p2p()
            elif scenario in ("engine-snapshot", "engine-snapshot-lean"):
                rec = self._engine_snapshot(lean=scenario.endswith("-lean"))
            elif scenario in ("zygote", "zygote-image", "zygote-image-newenv"):
                rec = self._zygote(image=scenario != "zygote", new_env=scenario.endswith("-newenv"))
            else:
                rec = self._one(scenario)
        except (RuntimeError, Cut) as exc:
            rec = {"name": scenario, "strategy": scenario, "error": str(exc)}
            if isinstance(exc, Cut):
                rec["cut"] = True
        rec.setdefault("mode", MODES.get(scenario, scenario))
        rec.update(evicted_bytes=evicted, at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   compile=COMPILE["on"], **({"wiped_jit_caches": wiped} if wiped is not None else {}))
        self.runs.append(rec)
        self.record_path.write_text(json.dumps(self.runs, indent=1))
        shown = {k: rec.get(k) for k in ("ready_s", "weight_s", "first_line_s", "engine_core_s", "verify", "error")}
        if rec.get("loaded_event"):  # p2p: which way the bytes came (NIXL, CUDA IPC, CUDA IPC + NIXL)
            shown["transport"] = rec["loaded_event"].get("transport")
        print(f"gpu_engine_e2e: {scenario}: {shown}", flush=True)
        return rec

    def _one(self, scenario: str) -> dict:
        port = free_port()
        extra: tuple[str, ...] = ()
        if scenario in ENGINE_OPTIONS:
            module = {"fastsafetensors": "fastsafetensors", "instanttensor": "instanttensor"}.get(scenario)
            why = importable(module) if module else None
            if why:
                return {"name": scenario, "strategy": scenario, "skipped": f"not installed: {why}"}
            extra = ENGINE_OPTIONS[scenario]
        argv = engine_argv(self.model, port, self.util, extra)
        launcher = scenario in LAUNCHED
        log = self._log(scenario)
        events = log.with_suffix(".events.jsonl") if launcher else None
        if launcher:
            flags = ("--no-engine-fork",) if scenario == "staged-spawn" else ()
            argv = mx("launch", "--json", "--artifact-path", str(self.store), "--no-p2p", *flags, "--", *argv)
        env = FORK_ENV if scenario == "default-fork" else None
        start = Start(argv, log, events, env)
        rec: dict = {"name": scenario, "strategy": {"default-fork": "default", "staged-spawn": "staged"}.get(scenario, scenario),
                     "command": ("VLLM_WORKER_MULTIPROC_METHOD=fork " if env else "") + shown_argv(argv)}
        try:
            rec["ready_s"] = start.wait_ready(port, self.timeout)
            if scenario == "capture":
                rec["published"] = start.wait_event("published", 300) is not None
            elif launcher:
                start.wait_event("loaded", 30)
            # the gold: the engine alone's answers; a batch without `default` takes the capture's (marked gold_from)
            record = scenario in ("default", "capture") and not self.gold.exists()
            if record and scenario == "capture":
                rec["gold_from"] = "this capture (no default in the batch)"
            rec["verify"] = verify(port, self.gold, record)
            if RECORD_EACH["on"] and not record:  # this start's own answers, to compare starts pairwise later
                own = log.with_suffix(".answers.json")
                rec["answers"] = str(own) if verify(port, own, record=True) == "gold" else None
            if scenario == "capture" and COMPILE["on"]:  # a server that lives on: its kernel cache is captured
                start.wait_event("kernel-cache-capture", 180)
        finally:
            start.stop(launcher)
        return self._finish(rec, start, log, launcher)

    def _finish(self, rec: dict, start: Start, log: Path, launcher: bool) -> dict:
        text = log.read_text(errors="replace")
        rec["log_times"] = {name: float(m.group(1)) for name, pattern in LOG_TIMES.items()
                            if (m := re.search(pattern, text))}
        opt = Option(rec["name"], ENGINE["name"], launch=() if launcher else None, once=rec["name"] == "capture")
        rec.update(read_log(opt, text, start.events))
        rec.update(first_line_s=start.first_line_s, engine_core_s=start.engine_core_s, log=str(log))
        if COMPILE["on"]:
            rec["autotune"] = autotune_choices()
        ready = start.event("ready")
        rec["phases"] = (ready or {}).get("phases") or profile_phases(log)
        if launcher:
            plan = start.event("plan") or {}
            rec["planned"] = plan.get("strategy")
            kc = start.event("kernel-cache") or {}
            rec["kernel_cache"] = kc.get("status")
            rec.update({k: kc[k] for k in ("seeded_files", "seeded_bytes") if k in kc})  # a first serve seeded from the node
            rec["kernel_cache_at_ready"] = (ready or {}).get("kernel_cache")  # `partial`: the engine compiled anyway
            kc_capture = start.event("kernel-cache-capture") or {}
            rec["kernel_cache_capture"] = {k: kc_capture.get(k) for k in ("status", "published", "new_files", "new_by_cache",
                                                                         "new", "files", "bytes", "reason") if k in kc_capture}
            rec["engine_start"] = plan.get("engine_start")
            rec["zygote"] = (start.event("zygote") or {}).get("status")
            rec["loaded_event"] = start.event("loaded")  # p2p: the pull's phases (transfer, verify, ...)
            rec["kept_bytes"] = (start.event("staged") or {}).get("kept_bytes")  # --keep-staged: linked, not read
            fallback = start.event("fallback")
            if fallback:
                rec["fallback"] = fallback.get("reason")
            if rec.get("fallback"):
                rec["error"] = f"fell back: {rec['fallback'][:300]}"
            elif rec["name"] != "capture" and rec.get("planned") != rec["strategy"]:
                rec["error"] = f"planned {rec.get('planned')!r}, not {rec['name']!r}: {plan.get('reason')}"
        return rec

    def _engine_snapshot(self, lean: bool = False) -> dict:
        """`launch --engine-snapshot` twice with one command: the first start serves and snapshots the engine
        (CUDA checkpoint + CRIU), the second restores it. The KV cache is in the image: --snapshot-util sizes it.
        lean: MXLAUNCH_SNAPSHOT_SLEEP=lean — neither weights nor KV cache in the image; the restore refills."""
        port = free_port()
        name = "engine-snapshot-lean" if lean else "engine-snapshot"
        env = {"MXLAUNCH_SNAPSHOT_SLEEP": "lean"} if lean else {}
        argv = mx("launch", "--json", "--artifact-path", str(self.store), "--engine-snapshot", "--",
                  *engine_argv(self.model, port, self.snapshot_util))
        rec: dict = {"name": name, "strategy": "snapshot", "mode": MODES.get(name),
                     "command": ("MXLAUNCH_SNAPSHOT_SLEEP=lean " if lean else "") + shown_argv(argv),
                     "util": self.snapshot_util}
        phases = ("first", "restored", "wiped") if lean else ("first", "restored")
        for phase in phases:
            log = self._log(f"{name}-{phase}")
            if phase == "wiped":  # a node that never ran it: only the store is left (the lean image is in it)
                rec["wiped"] = wipe_node()
            if phase != "first":
                evict(self.model, self.store)
            start = Start(argv, log, log.with_suffix(".events.jsonl"), env=env)
            try:
                ready = start.wait_ready(port, self.timeout)
                if phase == "first":
                    rec["first_ready_s"] = ready
                    rec["taken"] = start.wait_event("engine-snapshot", 600)
                    # The first engine serves on after its snapshot (woken, when it slept): its answers are the
                    # gold when no `default` ran before, else they are compared with it.
                    recording = not self.gold.exists()
                    rec["first_verify"] = verify(port, self.gold, recording)
                    rec["gold_from"] = "the first start, after its snapshot" if recording else "default"
                else:
                    key = "" if phase == "restored" else "wiped_"
                    rec[f"{key}ready_s"] = ready
                    start.wait_event("ready", 60)  # the launcher's own events (it sees /health a poll later)
                    rec[f"{key}launcher_ready"] = start.event("ready")
                    rec[f"{key}restored"] = start.event("engine-snapshot")
                    rec[f"{key}staged"] = start.event("staged")  # kept_bytes: linked from the last launch's stage
                    rec[f"{key}refilled"] = next((e for e in start.events if e.get("event") == "engine-snapshot"
                                                  and e.get("status") == "refilled"), None)
                    rec[f"{key}planned"] = (start.event("plan") or {}).get("strategy")
                    rec[f"{key}verify"] = verify(port, self.gold, False)
            finally:
                start.stop(True)
        rec["image_bytes"] = (rec.get("taken") or {}).get("bytes")
        rec["pause_s"] = (rec.get("taken") or {}).get("pause_s")  # the serving engine's pause for the snapshot
        restored = rec.get("restored") or {}  # CRIU's restore, then the GPU state's (and a wake, if it slept)
        parts = [restored.get(k) for k in ("criu_restore_s", "gpu_restore_s", "wake_s") if restored.get(k) is not None]
        rec["restore_s"] = round(sum(parts), 3) if parts else None
        for key in ("", "wiped_") if lean else ("",):
            if (rec.get(f"{key}restored") or {}).get("status") != "restored":
                rec.setdefault("error", f"{key or 'second start '}not restored: {rec.get(f'{key}restored')}")
            elif lean and not rec.get(f"{key}refilled"):
                rec.setdefault("error", f"{key or 'second start '}restored, but no refill was reported")
        return rec

    def _zygote(self, image: bool = False, new_env: bool = False) -> dict:
        """A restart from a warm interpreter: the first start leaves one (once ready), the second is forked.
        image: the first start's zygote is also dumped (CRIU) and stopped; the second restores it. new_env: each
        start runs as another Slurm job would (its own SLURM_* ids, HOSTNAME and TMPDIR)."""
        name = "zygote-image-newenv" if new_env else "zygote-image" if image else "zygote"

        def job_env(job: int) -> dict:
            if not new_env:
                return {}
            tmp = self.work / f"job-{job}-tmp"
            tmp.mkdir(exist_ok=True)
            return {"SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_NODELIST": f"gpu-{job}",
                    "SLURMD_NODENAME": f"gpu-{job}", "SLURM_STEP_ID": "0", "HOSTNAME": f"gpu-{job}", "TMPDIR": str(tmp)}

        def start(name: str, job: int) -> tuple[Start, int, Path]:
            port, log = free_port(), self._log(name)
            argv = mx("launch", "--json", "--artifact-path", str(self.store), "--no-p2p", "--zygote", "--",
                      *engine_argv(self.model, port, self.util))
            return Start(argv, log, log.with_suffix(".events.jsonl"), env=job_env(job)), port, log

        first, port, _ = start(f"{name}-first", 7001)
        sock: Optional[str] = None
        made: Optional[dict] = None
        try:
            first.wait_ready(port, self.timeout)
            started = first.wait_event("zygote", 30)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (sock := next((e.get("socket") for e in first.events
                                                                     if e.get("status") == "starting"), None)):
                time.sleep(0.2)
            if image and sock:  # the dump waits for the zygote's imports (~20 s for vLLM's API server here)
                made = first.wait_event("zygote-image", 180)
        finally:
            first.stop(True)
        if not sock:
            return {"name": name, "strategy": "staged", "error": f"no zygote started: {started}"}
        if image and (made or {}).get("status") != "published":
            Path(sock).unlink(missing_ok=True)
            return {"name": name, "strategy": "staged", "error": f"no zygote image: {made}"}
        deadline = time.monotonic() + 120
        while not Path(sock).exists() and time.monotonic() < deadline:  # it publishes once it has imported vLLM
            time.sleep(0.2)
        if image:  # a node's first start: no zygote waits, its image does
            zpid = (made or {}).get("pid")
            Path(sock).unlink(missing_ok=True)
            deadline = time.monotonic() + 30
            while zpid and os.path.exists(f"/proc/{zpid}") and time.monotonic() < deadline:
                time.sleep(0.05)
        evict(self.model, self.store)
        second, port, log = start(name, 7002)
        rec: dict = {"name": name, "strategy": "staged", "command": shown_argv(second.proc.args)}
        if made:
            rec["image"] = {k: made.get(k) for k in ("bytes", "dump_s", "restore_s")}
        try:
            rec["ready_s"] = second.wait_ready(port, self.timeout)
            second.wait_event("loaded", 30)
            rec["verify"] = verify(port, self.gold, record=False)
        finally:
            second.stop(True)
            Path(sock).unlink(missing_ok=True)  # the zygote exits within 2 s of its socket's removal
        rec = self._finish(rec, second, log, launcher=True)
        want = "restored" if image else "forked"
        if rec.get("zygote") != want and not rec.get("error"):
            rec["error"] = f"not {want} from the zygote: {rec.get('zygote')}"
        if image:
            rec["restore_s"] = (second.event("zygote") or {}).get("restore_s")
            rec["image_bytes"] = (made or {}).get("bytes")
        if new_env:
            rec["env"] = {k: v for k, v in job_env(7002).items() if k != "TMPDIR"} | {"TMPDIR": "a new folder"}
        return rec

    def _p2p(self) -> dict:
        # any of the modules the launcher looks for (launch/p2p.py _NIXL_MODULES): the CUDA 12 wheel is nixl_cu12
        why = importable("nixl_cu13") and importable("nixl") and importable("nixl_cu12")
        if why:
            return {"name": "p2p", "strategy": "p2p", "skipped": f"NIXL not installed: {why}"}
        half = round(self.util / 2, 3)
        src_port, dst_port = free_port(), free_port()
        src_log, dst_log = self._log("p2p-source"), self._log("p2p")
        src = Start(mx("launch", "--json", "--artifact-path", str(self.store), "--",
                       *engine_argv(self.model, src_port, half)), src_log, src_log.with_suffix(".events.jsonl"))
        dst: Optional[Start] = None
        rec: dict = {"name": "p2p", "strategy": "p2p"}
        try:
            rec["source_ready_s"] = src.wait_ready(src_port, self.timeout)
            source_loaded = src.wait_event("loaded", 60)
            rec["source_planned"] = (src.event("plan") or {}).get("strategy")
            rec["source_fallback"] = (src.event("fallback") or {}).get("reason")
            rec["source_strategy"] = (source_loaded or {}).get("strategy")
            if source_loaded is None:
                raise RuntimeError("the source never loaded its rank")
            time.sleep(2)  # its worker publishes the source record right after loading
            evict(self.model, self.store)
            argv = mx("launch", "--json", "--artifact-path", str(self.store), "--",
                      *engine_argv(self.model, dst_port, half))
            rec["command"] = shown_argv(argv)
            dst = Start(argv, dst_log, dst_log.with_suffix(".events.jsonl"))
            rec["ready_s"] = dst.wait_ready(dst_port, self.timeout)
            dst.wait_event("loaded", 30)
            rec["verify"] = verify(dst_port, self.gold, record=False)
            rec["source_verify"] = verify(src_port, self.gold, record=False)
        except RuntimeError as exc:  # the record keeps what was seen: the source's side, the puller's plan and log
            rec["error"] = f"{'the puller' if dst is not None else 'the source'}: {exc}"
        finally:
            if dst is not None:
                dst.stop(True)
            src.stop(True)
        if dst is None:
            return rec
        served = re.search(r"checksums in ([0-9.]+) s", src_log.read_text(errors="replace"))
        rec["source_checksum_s"] = float(served.group(1)) if served else None
        return self._finish(rec, dst, dst_log, launcher=True)


def gpu_name() -> Optional[str]:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True)
    except OSError:
        return None  # no NVIDIA driver here (a CPU dry run of the harness)
    return proc.stdout.strip() or None


def gpu_holders() -> list[str]:
    """"pid (N MiB)" of each process holding GPU memory now: a start needs the GPU to itself (its own
    --gpu-memory-utilization of the card), so a batch that finds one left by an earlier run fails every start."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True)
    except OSError:
        return []
    return [f"{pid.strip()} ({mib.strip()} MiB)" for pid, _, mib in
            (line.partition(",") for line in proc.stdout.splitlines() if "," in line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="default,capture,staged,staged")
    ap.add_argument("--size", default="8GiB", help="make_tiny_model.py --size (default 8GiB)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-e2e"))
    ap.add_argument("--util", type=float, default=0.7, help="--gpu-memory-utilization (p2p: half each)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds to ready, per start")
    ap.add_argument("--snapshot-util", type=float, default=0.12, help="engine-snapshot: --gpu-memory-utilization, SGLang's "
                    "--mem-fraction-static (the image holds the engine's GPU memory, KV cache included)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON record (every run so far in the work folder)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="sglang: SGLang's kit "
                    "(docs/sglang-gpu.md), FlashInfer attention, PyTorch sampling")
    ap.add_argument("--sglang-attention", choices=("flashinfer", "triton", "torch_native"), default="flashinfer",
                    help="SGLang's --attention-backend (flashinfer: a fresh node JIT-builds its kernels in the first "
                    "request, ~3 min; torch_native: the CPU dry run)")
    ap.add_argument("--sglang-args", default="", help="flags appended to every SGLang start, e.g. for a CPU dry run "
                    "'--device cpu --dtype float32 --max-total-tokens 2048' (docs/sglang-gpu.md)")
    ap.add_argument("--compile", action="store_true", help="vLLM's default compile and CUDA graphs (no --enforce-eager; "
                    "SGLang: CUDA graphs, no --disable-cuda-graph)")
    ap.add_argument("--fresh-node", action="store_true", help="remove this machine's JIT kernel caches before every "
                    "start (the store stays): each start as on a node that never ran the model")
    ap.add_argument("--record-each", action="store_true", help="also record every start's own answers "
                    "(logs/NN-name.answers.json), to compare starts with each other, not only with the gold")
    ap.add_argument("--quant", choices=tuple(QUANT_METHODS), help="serve the model quantized (issue 40): fp8-online "
                    "(--quantization fp8) or a pre-quantized checkpoint written from it; use a --work of its own")
    ap.add_argument("--moe", action="store_true", help="serve a Mixtral made from the Llama's tokenizer instead (8 "
                    "experts, top 2, ~4.1 GiB bf16: tests/helpers/quantized_model.py GPU_MOE), quantized by --quant "
                    "(w8a8-fp8: compressed-tensors per-channel FP8 MoE); records say method '<quant>-moe'")
    ap.add_argument("--models", type=Path, help="where the generated models live (default: --work); one folder for "
                    "several --work folders makes the 8 GiB Llama once")
    ap.add_argument("--quant-out", type=Path, help="with --quant: add one record per start (method, engine, strategy, "
                    "verify, fallback, weight_s) to this JSON file, e.g. docs/bench-results/quantized_<date>.json")
    ap.add_argument("--gpu-shared", action="store_true", help="start even though other processes hold GPU memory")
    ap.add_argument("--logs-out", type=Path, help="copy each start's log and events here as it ends (e.g. $OUT/logs): "
                    "the work folder stays on the GPU machine, and a start that went wrong is read from its log")
    ap.add_argument("--flashinfer-sampler", action="store_true", help="leave VLLM_USE_FLASHINFER_SAMPLER unset (vLLM's "
                    "default on CUDA: FlashInfer's sampler, JIT-built on a node's first start)")
    args = ap.parse_args()
    held = gpu_holders()
    if held and not args.gpu_shared:
        sys.exit(f"gpu_engine_e2e: the GPU is held by {', '.join(held)} — an engine an earlier run left (a run cut by "
                 "timeout before session 31's harness)? Stop it (kill the pid), or pass --gpu-shared")
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}: pick from {', '.join(SCENARIOS)}")
    models = args.models or args.work
    model = models / f"llama-{args.size}"
    if not (model / "config.json").exists():
        models.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(REPO / "scripts" / "kits" / "make_tiny_model.py"), "--out", str(model),
                        "--size", args.size], check=True)
    args.work.mkdir(parents=True, exist_ok=True)
    model, method = quant_model(model, models, args.size, args.quant, args.moe)
    QUANT["method"], QUANT["extra"], QUANT["name"] = method, QUANT_METHODS.get(args.quant or "", ()), args.quant
    COMPILE["on"] = args.compile
    ENGINE["name"], ENGINE["attention"] = args.engine, args.sglang_attention
    SGLANG_EXTRA[:] = shlex.split(args.sglang_args)
    if args.engine == "sglang" and set(scenarios) - set(SGLANG_SCENARIOS):
        ap.error(f"--engine sglang runs {', '.join(SGLANG_SCENARIOS)} only (no lean snapshot: mxlaunch puts no SGLang "
                 f"engine to sleep), not {', '.join(sorted(set(scenarios) - set(SGLANG_SCENARIOS)))}")
    RECORD_EACH["on"] = args.record_each
    if args.flashinfer_sampler:
        ENV.pop("VLLM_USE_FLASHINFER_SAMPLER", None)
    harness = Harness(args.work, model, args.util, args.timeout)
    harness.fresh_node = args.fresh_node
    harness.snapshot_util = args.snapshot_util
    import importlib  # noqa: PLC0415 — only for its version, in the engine's environment

    version = importlib.import_module(ENGINE["name"]).__version__
    doc = {"schema": 1, "engine": ENGINE["name"], "engine_version": version, "gpu": gpu_name(),
           "date": dt.date.today().isoformat(), "model": {"size": args.size, "name": model.name,
           "bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))},
           "env": ENV, "command": shown_argv([sys.executable, *sys.argv]), "runs": harness.runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _cut)
    for scenario in scenarios:  # the record is rewritten after every start: a run cut short keeps what it did
        rec = harness.run(scenario)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        if args.logs_out:
            copy_logs(harness.logs, args.logs_out)
        if method and args.quant_out:
            add_quant_record(args.quant_out, rec, method, version, doc, harness.runs)
        if rec.get("cut"):
            print_table(harness.runs)
            return 128 + signal.SIGTERM
    print_table(harness.runs)
    return 0


# vLLM's own lines naming the kernels it chose (0.26): "Selected CutlassFP8ScaledMMLinearKernel for Fp8LinearMethod",
# "Using TRITON Fp8 MoE backend out of potential backends: [...]" (block-fp8's linear: a DeepGEMM kernel class)
KERNEL_LINES = (r"Selected (\w+) for (\w+)", r"Using (\w+) Fp8 MoE backend", r"Using (\w+) for \w+ GEMM")


def copy_logs(src: Path, dst: Path) -> None:
    """The work folder's logs and event files → dst (those not there yet, or grown since)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*")):
        if f.is_file() and f.suffix in (".log", ".jsonl") and (not (dst / f.name).exists()
                                                              or (dst / f.name).stat().st_size != f.stat().st_size):
            shutil.copyfile(f, dst / f.name)


def kernels_of(log: Optional[str]) -> list[str]:
    """The kernels the engine said it chose for a start's quantized layers (its log), once each, in order."""
    try:
        text = Path(log).read_text(errors="replace") if log else ""
    except OSError:
        return []
    found = [" ".join(m.groups()) for pattern in KERNEL_LINES for m in re.finditer(pattern, text)]
    return list(dict.fromkeys(found))


def add_quant_record(path: Path, rec: dict, method: str, version: str, doc: dict, runs: list[dict]) -> None:
    """One record per start in the quantized results file (issue 40's targets), added to what it holds. A start
    after a `default` that was not the gold's (`default,default,capture`: the engine alone with warm caches)
    carries that start's ready_s and its own ratio to it (the target: capture ≤ 1.05×)."""
    data = json.loads(path.read_text()) if path.exists() else {"schema": 1, "gpu": doc["gpu"], "model": doc["model"],
                                                                "records": []}
    alone = [r.get("ready_s") for r in runs[:-1] if r.get("name") == "default" and r.get("verify") == "exact"]
    alone_s = alone[-1] if alone and alone[-1] and rec.get("ready_s") else None
    data["records"].append({
        "method": method, "engine": ENGINE["name"], "engine_version": version, "start": rec.get("name"),
        "model": doc["model"].get("name"),
        "strategy": rec.get("strategy"), "planned": rec.get("planned"),
        "verify": rec.get("verify") or rec.get("error") or rec.get("skipped"),
        "fallback": bool(rec.get("fallback")), "fallback_reason": rec.get("fallback"),
        "weight_s": rec.get("weight_s"), "ready_s": rec.get("ready_s"), "compile": COMPILE["on"], "at": rec.get("at"),
        # online quantization: the staged/p2p restore first quantizes placeholders (not in the "loaded" line's time)
        "placeholder_s": ((rec.get("loaded_event") or {}).get("placeholders") or {}).get("seconds"),
        "engine_alone_ready_s": alone_s, "ready_vs_engine_alone": round(rec["ready_s"] / alone_s, 3) if alone_s else None,
        # p2p: the staged source the puller pulled from, and how the bytes came
        **({"source_strategy": rec.get("source_strategy"), "source_fallback": rec.get("source_fallback"),
            "transport": (rec.get("loaded_event") or {}).get("transport")} if rec.get("name") == "p2p" else {}),
        "kernels": kernels_of(rec.get("log"))})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def print_table(runs: list[dict]) -> None:
    print("| start | strategy | ready (s, from spawn) | weight phase (s) | first line (s) | engine core (s) | verify |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        cells = [r.get(k) for k in ("ready_s", "weight_s", "first_line_s", "engine_core_s")]
        shown = ["—" if v is None else f"{v:.2f}" for v in cells]
        note = r.get("verify") or r.get("skipped") or r.get("error") or "—"
        print(f"| {r['name']} | {r.get('strategy')} | " + " | ".join(shown) + f" | {note} |")
    tuned = [r for r in runs if r.get("autotune")]
    for r in tuned[1:]:  # each compile start's autotune choices against the first one's
        first, own = tuned[0]["autotune"], r["autotune"]
        common = set(first) & set(own)
        differ = sorted(k for k in common if first[k] != own[k])
        print(f"autotune {tuned[0]['name']} vs {r['name']}: {len(common)} kernels in both, {len(differ)} chose "
              f"differently, {len(set(own) - set(first))} only in the later one")


if __name__ == "__main__":
    sys.exit(main())
