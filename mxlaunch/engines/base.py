"""Engine-neutral shapes shared by the engine modules.

Only what more than one engine module needs lives here. `profile` uses the log-line
shapes below; the launch pipeline uses `LaunchSpec` (what a launch command asks for), which every
engine's argv parser fills the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional, Protocol

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
        events = [PhaseEvent("elapsed", "weight_loading", rank=f"rank{m.group(1)}", seconds=float(m.group(3)), priority=10)]
        if m.group(4) == "p2p":  # the pull over NIXL: inside the weight phase, shown on its own
            events.append(PhaseEvent("elapsed", "p2p", rank=f"rank{m.group(1)}", seconds=float(m.group(3)), priority=10))
        return events
    m = MXLAUNCH_STAGED.search(text)
    if m:
        return [PhaseEvent("elapsed", "stage", seconds=float(m.group(2)), priority=10)]
    return []


# ---- launch commands ----------------------------------------------------------------------------


@dataclass
class LaunchSpec:
    """What an engine's launch command asks for, in engine-neutral terms.

    Filled by an engine module's argv parser (`engines.vllm_argv.parse_vllm_argv`; SGLang's fills the same
    fields). Values are the engine's *effective* settings: the command line, its `--config` file and the
    engine's defaults, combined as the engine combines them. `argv` is the command exactly as given;
    a plan's command is made from it by the engine module's rewrite function, never by hand.

    Parallelism: `tp`, `pp`, `dp` are the group sizes; `expert_parallel` says whether MoE experts are
    partitioned over an expert-parallel group and `ep` is that group's size (1 = experts are not split
    over EP; vLLM's EP group is tp × dp, SGLang sets it with --ep-size). `nnodes`/`node_rank` place this
    node in a multi-node run; `dp_size_local`/`dp_start_rank`/`headless` (None/False when not given)
    say which DP replicas this node hosts.

    `layout_extras` holds engine-specific settings that change the per-rank tensors (vLLM:
    --hf-overrides, --model-impl) so that the source id covers them; only non-default values appear.
    `unsafe_reasons` lists why mxlaunch must serve this command with the engine's default loader
    (empty: a fast path may be tried). Each reason is one line a user can act on.
    """

    engine: str  # "vllm" | "sglang"
    engine_version: Optional[str]  # None: the engine is not installed here (a login node)
    launch_form: str  # "vllm serve", "python -m vllm.entrypoints.openai.api_server", ...
    model: str  # as given on the command line (or in its config file)
    model_path: Optional[str]  # resolved local directory (hub ids → the local hub-cache snapshot), or None
    served_model_name: str  # the name clients use (the first one when several are given)
    argv: List[str] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    ep: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dp_size_local: Optional[int] = None
    dp_start_rank: Optional[int] = None
    headless: bool = False
    dtype: str = "auto"
    quantization: Optional[str] = None
    load_format: str = "auto"
    model_loader_extra_config: Optional[Dict[str, Any]] = None
    host: Optional[str] = None
    port: Optional[int] = None
    device: Optional[str] = None  # the command's --device (SGLang), None when not given
    revision: Optional[str] = None
    layout_extras: Dict[str, Any] = field(default_factory=dict)
    unsafe_reasons: List[str] = field(default_factory=list)

    @property
    def safe(self) -> bool:
        """True when nothing forces the engine's default loader."""
        return not self.unsafe_reasons

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready copy (lists and dicts copied, nothing shared with the spec)."""
        return json.loads(json.dumps(asdict(self)))


def splice_argv(argv: List[str], drop: Dict[int, str], replace: Dict[str, List[str]]) -> List[str]:
    """argv with the tokens at the `drop` indexes (each tagged with the flag it belongs to) taken out: a
    flag's replacement tokens go where its first dropped token stood, or at the end when none was dropped.
    Everything else keeps its place. The engines' rewrite functions use it so that a command changes only
    where mxlaunch must change it."""
    out: List[str] = []
    placed = set()
    for k, tok in enumerate(argv):
        flag = drop.get(k)
        if flag is None:
            out.append(tok)
        elif flag not in placed:
            out += replace[flag]
            placed.add(flag)
    for flag, toks in replace.items():
        if flag not in placed:
            out += toks
    return out
