"""Engine-neutral shapes shared by the engine modules.

Only what more than one engine module needs lives here. `profile` uses the log-line
shapes below; the launch pipeline adds its own (LaunchSpec, ...) next to them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import List, Optional, Protocol

# ---- log lines ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogLine:
    """One engine log line, split into the parts every engine has."""

    ts: Optional[float]  # seconds since the epoch, from the line's own timestamp (None: it has none)
    rank: Optional[str]  # "TP0", "PP0 TP3", ... (None: the front-end or a single process)
    message: str  # the text after the engine's prefix
    proc: Optional[str] = None  # the process tag where the engine prints one ("EngineCore_DP0", "Worker_TP1")


@dataclass(frozen=True)
class PhaseEvent:
    """Something a log line says about start-up.

    kind: "elapsed" (the engine printed the phase's duration: `seconds`), "begin"/"end" (a
    phase boundary, timed from timestamps), or "mark" (a named point: spawn, engine_ready,
    http_up, ready, worker_ready, role_worker). `priority` ranks several spellings of the same
    phase: the highest one seen wins (e.g. vLLM's "Model loading took" over "Loading weights took").
    """

    kind: str
    name: str
    rank: Optional[str] = None
    seconds: Optional[float] = None
    priority: int = 0
    label: str = ""  # distinct captures of one phase on one rank (SGLang decode + draft graphs) add up


class LogFormat(Protocol):
    """What an engine module knows about its own start-up log (see engines/sglang.py, vllm.py)."""

    name: str

    def split(self, line: str) -> Optional[LogLine]:
        """The line's timestamp, rank and message if it is this engine's line, else None."""

    def bare_message(self, line: str) -> str:
        """The message of a line without a timestamp (uvicorn lines, process-prefixed or not)."""

    def events(self, line: LogLine) -> List[PhaseEvent]:
        """Start-up events that the message reports."""


def epoch(dt: datetime) -> float:
    """Naive local timestamps → float seconds; only differences matter, so no time zone."""
    return (dt - datetime(1970, 1, 1)).total_seconds()


NUM = r"([0-9]+(?:\.[0-9]+)?)"

# mxlaunch's own lines (the plugin and the launcher print them; either engine's prefix may precede).
MXLAUNCH_LOADED = re.compile(r"mxlaunch: rank (\S+) loaded " + NUM + r" GiB in " + NUM + r" s \(strategy (\S+)\)")
MXLAUNCH_STAGED = re.compile(r"mxlaunch: staged " + NUM + r" GiB in " + NUM + r" s")


def mxlaunch_events(text: str) -> List[PhaseEvent]:
    """mxlaunch's own weight-loading and staging lines, whatever engine prefix they carry."""
    m = MXLAUNCH_LOADED.search(text)
    if m:
        return [PhaseEvent("elapsed", "weight_loading", rank=f"rank{m.group(1)}", seconds=float(m.group(3)), priority=10)]
    m = MXLAUNCH_STAGED.search(text)
    if m:
        return [PhaseEvent("elapsed", "stage", seconds=float(m.group(2)), priority=10)]
    return []
