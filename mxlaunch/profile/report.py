"""Runs → statistics, the `--json` document and the tables `mxlaunch profile` prints.

Why its own module: profiler.py turns log lines into one run's phases; what is done with finished runs
(mean/stddev per phase, the JSON report, rich tables, the `--explain` listing) is separate and needs no parser.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

from mxlaunch.profile.model import PHASES, RunProfile


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


def silence_lines(run: RunProfile) -> List[str]:
    """The stretches no log line covers, with what probably ran there (their time is inside some phase)."""
    from rich.markup import escape  # noqa: PLC0415

    return [f"silent {x.seconds:.1f} s from {x.at:.1f} s, after: {escape(x.after)}"
            + (f" — likely {escape(x.likely)}" if x.likely else "") for x in run.silences]


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
            pct = "overlaps" if name == "stage" else "in weights" if name == "p2p" else (f"{100 * s / run.total_seconds:.1f}" if run.total_seconds else "-")
            table.add_row(name, f"{s:.2f}", pct)
        table.add_row("[bold]total[/]", f"[bold]{run.total_seconds:.2f}[/]", "100.0")
        return [summary, table, *silence_lines(run)]
    for col in ("mean", "std", "min", "max", "n"):  # per-run values: --json and --chart
        table.add_column(col, justify="right", no_wrap=True)
    for name in names + ["total_seconds"]:
        st = stats[name]
        label = "[bold]total[/]" if name == "total_seconds" else name
        table.add_row(label, *(f"{st[k]:.2f}" for k in ("mean", "std", "min", "max")), str(st["n"]))
    return [summary, table]
