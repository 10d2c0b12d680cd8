"""Which workers of this node write which snapshot rank of a capture (launch/capture.py runs the capture; the
plan, launch/decide.py and launch/capture_route.py, asks here too).

**Who writes what.** One copy per snapshot rank: the workers of DP replica 0 write it (`capture_part`);
the other replicas' workers serve without capturing. A TP×PP world spread over N nodes is one capture
of N parts, one per node, all under one capture id — the Slurm job step's (`slurm.job_capture_id`) or
`mxlaunch launch --capture-id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mxlaunch.contract import SHARED_FOLDER_FORMATS

if TYPE_CHECKING:
    from mxlaunch.launch.decide import LaunchPlan


@dataclass(frozen=True)
class CapturePart:
    """This node's share of a capture: `workers` maps each capturing worker (its rank, the plan's key)
    to the snapshot rank it writes; empty when this node writes nothing (`why_not` says why)."""

    nranks: int
    nnodes: int  # nodes writing a part of this capture
    node_rank: int  # this node's index among them
    workers: dict[int, int] = field(default_factory=dict)
    why_not: str = ""

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.workers.values()))


def snapshot_nranks(plan: "LaunchPlan") -> int:
    return 1 if plan.snapshot_format in SHARED_FOLDER_FORMATS else plan.spec.tp * plan.spec.pp


def capture_part(local_ranks: list[dict], nranks: int) -> CapturePart:
    """One copy per snapshot rank: DP replica 0's workers on this node capture, other replicas skip it.

    The nodes holding replica 0 split its ranks evenly and in order (TP×PP over N nodes), so this
    node's share tells the node count and its index: ranks 4–7 of 8 → node 1 of 2."""
    workers = {w["rank"]: w["snapshot_rank"] for w in local_ranks if w.get("dp_rank", 0) == 0}
    if not workers:
        replicas = sorted({w.get("dp_rank", 0) for w in local_ranks})
        return CapturePart(nranks, 0, 0, {}, f"this node runs DP replica(s) {', '.join(map(str, replicas))} only: the "
                                              "node running DP replica 0 captures the snapshot (one copy per rank)")
    ranks = sorted(set(workers.values()))
    per = len(ranks)
    if nranks % per or ranks != list(range(ranks[0], ranks[0] + per)) or ranks[0] % per or ranks[-1] >= nranks:
        return CapturePart(nranks, 0, 0, {}, f"this node's snapshot ranks {ranks} are not an even, in-order share of "
                                              f"{nranks} ranks, which a capture over several nodes needs")
    return CapturePart(nranks, nranks // per, ranks[0] // per, workers)
