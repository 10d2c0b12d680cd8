"""PNG chart of start-up phases: one stacked bar per run (matplotlib is the optional extra `chart`).

A breakdown is read at a glance; a table of 12 numbers per run is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mxlaunch.errors import UsageError
from mxlaunch.profile.model import NOT_SUMMED, PHASES, RunProfile


def write_chart(runs: Sequence[RunProfile], path: Path) -> Path:
    """Stacked bars (named phases, then `unknown`; `stage` overlaps so it is left out)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # The backslash keeps rich (cli.main prints errors with markup on) from eating "[chart]".
        raise UsageError("--chart needs matplotlib", fix="pip install 'mxlaunch[chart]'")
    stacked = [n for n in PHASES if n not in NOT_SUMMED] + ["unknown"]
    names = [n for n in stacked if any(r.seconds(n) for r in runs)]
    labels = [f"run {i}" + ("" if r.ready else " (not ready)") for i, r in enumerate(runs, 1)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(runs) + 3), 5))
    bottoms = [0.0] * len(runs)
    cmap = plt.get_cmap("tab20")
    for name in names:
        heights = [r.seconds(name) or 0.0 for r in runs]
        color = "#bbbbbb" if name == "unknown" else cmap(PHASES.index(name))  # same colour in every chart
        ax.bar(labels, heights, bottom=bottoms, label=name, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("seconds")
    ax.set_title("start-up phases per run")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}", fix="choose a writable --chart path")
    finally:
        plt.close(fig)
    return Path(path)
