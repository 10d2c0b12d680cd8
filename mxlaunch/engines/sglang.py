"""SGLang: what mxlaunch knows about it from outside the engine process.

This module reads its start-up log lines (phases, ready line, worker-node line; used by `profile` and
the launcher's timeline); engines/sglang_argv.py reads its launch commands.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import List, Optional

from mxlaunch.engines.base import NUM, LogLine, PhaseEvent, epoch

# ==== log lines ===================================================================================
# Line: `[YYYY-MM-DD HH:MM:SS{.mmm}{ DPn}{ PPn}{ TPn}{ EPn}] message` (ms only with SGLANG_LOG_MS).
# Wording covered: 0.5.10–0.5.x ("Init torch distributed", "Capture cuda graph end. Time elapsed",
# "Capture piecewise CUDA graph end. Time elapsed") and 0.5.23 ("Init parallel", "Capture target
# decode/prefill CUDA graph end. elapsed=", "Engine startup timings (s): ..."); older "Load weight
# end." without elapsed is timed from its begin line.

_LINE = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:[.,](\d+))?((?: [A-Z]+\d+)*)\] ?(.*)$")

_EMBEDDED = re.compile(r"(?<=[\]|]) ?\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")  # after a bar's "]" or "|"

_SERVER_ARGS = re.compile(r"server_args=ServerArgs\(")
_NODE_RANK = re.compile(r"\bnode_rank=(\d+)")
_DIST_BEGIN = re.compile(r"^Init (?:torch distributed|parallel) begin")
_DIST_END = re.compile(r"^Init (?:torch distributed|parallel) ends?\.(?: elapsed=" + NUM + r" ?s)?")
_LOAD_BEGIN = re.compile(r"^Load weight begin")
_LOAD_END = re.compile(r"^Load weight end\.(?: elapsed=" + NUM + r" ?s)?")
_POOL_END = re.compile(r"^Memory pool end")
# Old: "Capture cuda graph begin." / "Capture piecewise CUDA graph begin."; 0.5.23
# srt/model_executor/model_runner_components/cuda_graph_setup.py:685/:694 f"Capture {capture_name} CUDA graph
# begin/end. ... elapsed={capture_time:.2f} s" (capture_name "target prefill"), :759/:788 f"Capture {capture_name}
# {graph_backend[device]} begin/end. ... elapsed=..." (capture_name "target decode"/"target verify"; the backend is
# "CUDA graph", "CPU graph", "NPU graph", ... :740); speculative workers: "Capture draft decode/extend CUDA graph",
# "Capture UNO tree draft CUDA graph", "Capture Frozen-KV MTP draft cuda graph" (srt/speculative/*.py).
_GRAPH = re.compile(
    r"^Capture (?P<name>(?:[\w-]+ )*?)\w+ graph (?P<edge>begin|end)\.?"
    r"(?:.*?(?:Time elapsed: |elapsed=)" + NUM + r" ?s)?",
    re.IGNORECASE,
)
# Inside the piecewise capture (timed by its end line): srt/compilation/backend.py:211 "Compiling a graph for
# dynamic shape takes %.2f s", :213 "Compiling a graph for shape %s takes %.2f s", :185 "Cache the graph for
# dynamic shape for later use".
_INSIDE_PIECEWISE = re.compile(r"^(?:Compiling a graph for (?:dynamic shape|shape .*) takes|Cache the graph for )")
_TIMINGS = re.compile(r"^Engine startup timings \(s\): (.*)$")
_TIMING_ITEM = re.compile(r"(\w+)=" + NUM)
_TIMING_GRAPHS = re.compile(r"cuda_graph=\{([^}]*)\}")
_SCHEDULER_READY = re.compile(r"^max_total_num_tokens=")
_HTTP_UP = re.compile(r"(?:INFO:\s+)?(?:Uvicorn running on|Application startup complete\.)")
_READY = re.compile(r"The server is fired up and ready to roll!")
_WORKER_READY = re.compile(r"Dummy health check server started")


def _graph_phase(name: str) -> tuple[str, str]:
    """Phase and label of one graph capture line: prefill graphs are the piecewise phase; distinct captures
    (draft decode, target verify, ...) get labels so that they add up."""
    label = "_".join(name.lower().split())
    if label in ("piecewise", "target_prefill"):
        return "piecewise_cuda_graph_capture", ""
    return "cuda_graph_capture", "" if label == "target_decode" else label


class SGLangLog:
    """SGLang's start-up log (see the module docstring for the versions covered)."""

    name = "sglang"
    # what runs without a line: SGLang's warm-up request (health is 503 until it is answered) JIT-builds the
    # attention backend's kernels on a node's first start (H200, SGLang 0.5.16: FlashInfer 181 s, Triton 78 s)
    silent_work = ((r"attention_backend='flashinfer'",
                    "FlashInfer's JIT build of its attention kernels in the warm-up request (a node's first start; "
                    "mxlaunch's kernel cache keeps it)", _HTTP_UP.pattern),
                   (r"attention_backend='triton'",
                    "Triton's JIT build of the attention kernels in the warm-up request (a node's first start; "
                    "mxlaunch's kernel cache keeps it)", _HTTP_UP.pattern))

    def split(self, line: str) -> Optional[LogLine]:
        m = _LINE.match(line)
        if not m:  # a rank's line printed behind another rank's tqdm bar, on the same physical line
            at = _EMBEDDED.search(line)
            m = _LINE.match(line[at.start():].lstrip()) if at else None
        if not m:
            return None
        ts = epoch(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        if m.group(2):
            ts += float("0." + m.group(2))
        tags = m.group(3).strip()
        return LogLine(ts=ts, rank=tags or None, message=m.group(4), proc=None)

    def bare_message(self, line: str) -> str:
        return line.strip()

    def events(self, line: LogLine) -> List[PhaseEvent]:
        msg, rank = line.message, line.rank
        if _SERVER_ARGS.search(msg):
            out = [PhaseEvent("mark", "spawn")]
            node = _NODE_RANK.search(msg)
            if node and int(node.group(1)) > 0:
                out.append(PhaseEvent("mark", "role_worker"))
            return out
        if _DIST_BEGIN.match(msg):
            return [PhaseEvent("begin", "dist_init", rank)]
        m = _DIST_END.match(msg)
        if m:
            return _end_and_elapsed("dist_init", rank, m.group(1))
        if _LOAD_BEGIN.match(msg):
            return [PhaseEvent("begin", "weight_loading", rank)]
        m = _LOAD_END.match(msg)
        if m:
            return _end_and_elapsed("weight_loading", rank, m.group(1)) + [PhaseEvent("begin", "kv_cache_alloc", rank)]
        if _POOL_END.match(msg):
            return [PhaseEvent("end", "kv_cache_alloc", rank)]
        m = _GRAPH.match(msg)
        if m:
            phase, label = _graph_phase(m.group("name"))
            if m.group("edge").lower() == "begin":
                return [PhaseEvent("begin", phase, rank)]
            return _end_and_elapsed(phase, rank, m.group(3), label)
        if _INSIDE_PIECEWISE.match(msg):
            return [PhaseEvent("note", "piecewise_cuda_graph_capture", rank)]
        m = _TIMINGS.match(msg)
        if m:
            return _timings(m.group(1))
        if _SCHEDULER_READY.match(msg):
            return [PhaseEvent("mark", "engine_ready")]
        if _WORKER_READY.search(msg):
            return [PhaseEvent("mark", "role_worker"), PhaseEvent("mark", "worker_ready")]
        if _READY.search(msg):
            return [PhaseEvent("mark", "ready")]
        if _HTTP_UP.match(msg):
            return [PhaseEvent("mark", "http_up")]
        return []


def _end_and_elapsed(phase: str, rank: Optional[str], seconds: Optional[str], label: str = "") -> List[PhaseEvent]:
    out = [PhaseEvent("end", phase, rank)]
    if seconds is not None:
        out.append(PhaseEvent("elapsed", phase, rank, float(seconds), label=label))
    return out


def _timings(body: str) -> List[PhaseEvent]:
    """0.5.23's summary line; its figures count as one more 'rank' so the slowest still wins."""
    graphs = _TIMING_GRAPHS.search(body)
    flat = _TIMING_GRAPHS.sub("", body)
    items = {k: float(v) for k, v in _TIMING_ITEM.findall(flat)}
    out: List[PhaseEvent] = []
    if "load_weight" in items:
        out.append(PhaseEvent("elapsed", "weight_loading", "timings", items["load_weight"]))
    if "kv_cache_allocation" in items:
        out.append(PhaseEvent("elapsed", "kv_cache_alloc", "timings", items["kv_cache_allocation"]))
    if graphs:
        for key, value in _TIMING_ITEM.findall(graphs.group(1)):
            phase = "piecewise_cuda_graph_capture" if key == "prefill" else "cuda_graph_capture"
            out.append(PhaseEvent("elapsed", phase, "timings", float(value), label=key))
    return out
