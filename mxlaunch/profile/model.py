"""What a start-up profile is: the fixed phase names, one run's phases, and several nodes merged into one run.

Why its own module: the parser (profiler.py), the statistics and tables (report.py), live runs
(live.py) and the chart (chart.py) all speak these types; keeping them apart from the parser lets
each of those import the vocabulary without the log machinery, and with no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mxlaunch.errors import UsageError

PHASES: Tuple[str, ...] = (
    "image_restore",  # launch only: a CRIU image (engine snapshot, zygote) staged and restored, before any line
    "refill",  # launch only: a lean engine snapshot's weights refilled, before the restored engine prints
    "interpreter_startup",  # live runs only: spawn → the engine's first output line (less the two above)
    "process_startup",
    "worker_spawn",
    "dist_init",
    "weight_loading",
    "kv_cache_alloc",
    "torch_compile",
    "cuda_graph_capture",
    "piecewise_cuda_graph_capture",
    "http_startup",
    "warmup",
    "stage",
    "p2p",
    "unknown",
)
NOT_SUMMED = {"stage", "p2p", "unknown"}  # stage overlaps the engine's start; p2p is inside weight_loading


@dataclass
class Phase:
    name: str
    seconds: float


@dataclass
class Silence:
    """A stretch of the start-up with no engine log line: work no phase line names (a JIT build, say)."""

    at: float  # seconds from the run's start to the last line before it
    seconds: float
    after: str  # that line's message (shortened)
    likely: Optional[str] = None  # what an earlier line says ran there, when the engine's log tells


@dataclass
class RunProfile:
    """One run (or one merged multi-node run): what `--json` prints per run."""

    source: str
    engine: str
    role: str  # "server" (prints the ready line), "worker" (worker node of a multi-node run)
    ready: bool
    total_seconds: float
    phases: List[Phase] = field(default_factory=list)
    unmatched: List[str] = field(default_factory=list)  # timed lines no pattern read (`--explain`)
    silences: List[Silence] = field(default_factory=list)  # gaps of SILENCE_S or more between engine lines

    def seconds(self, name: str) -> Optional[float]:
        for p in self.phases:
            if p.name == name:
                return p.seconds
        return None

    def to_dict(self, explain: bool = False) -> dict:
        out = {
            "source": self.source,
            "engine": self.engine,
            "role": self.role,
            "ready": self.ready,
            "total_seconds": round(self.total_seconds, 3),
            "phases": [{"name": p.name, "seconds": round(p.seconds, 3)} for p in self.phases],
            "silences": [{"at": round(x.at, 3), "seconds": round(x.seconds, 3), "after": x.after, "likely": x.likely}
                         for x in self.silences],
        }
        if explain:
            out["unmatched"] = list(self.unmatched)
        return out


def merge_nodes(runs: Sequence[RunProfile], source: Optional[str] = None) -> RunProfile:
    """The nodes of one multi-node run → one run: the slowest node per phase; ready when all are."""
    if not runs:
        raise UsageError("nothing to merge", fix="pass one --log per node with --multinode")
    merged: Dict[str, float] = {}
    for run in runs:
        for p in run.phases:
            if p.name != "unknown":
                merged[p.name] = max(merged.get(p.name, 0.0), p.seconds)
    total = max(r.total_seconds for r in runs)
    merged["unknown"] = max(0.0, total - sum(v for k, v in merged.items() if k not in NOT_SUMMED))
    role = "server" if any(r.role == "server" for r in runs) else "worker"
    engines = sorted({r.engine for r in runs})
    return RunProfile(
        source=source or " + ".join(r.source for r in runs),
        engine=engines[0] if len(engines) == 1 else "/".join(engines),
        role=role,
        ready=all(r.ready for r in runs),
        total_seconds=total,
        phases=[Phase(n, merged[n]) for n in PHASES if n in merged],
        unmatched=[line for r in runs for line in r.unmatched],
        silences=[x for r in runs for x in r.silences],
    )
