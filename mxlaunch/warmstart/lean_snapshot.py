"""Lean engine snapshots: the engine's processes and GPU state without its weights and KV cache.

Why: a full engine snapshot of the 8 GiB Llama on the H200 was 20.7 GB — the weights and the KV cache — and its
restore is bound by reading those bytes back (~1.8 GB/s), while the weights are in the artifact store already
and the staged path copies them into GPU memory at the link's speed, and the KV cache of an idle engine is
garbage. So with `MXLAUNCH_SNAPSHOT_SLEEP=lean` the engine (vLLM with --enable-sleep-mode and mxlaunch's
worker extension) sleeps at level 2 while it is snapshotted: its weights' and KV cache's memory is released
(their virtual addresses kept, so the CUDA graphs stay valid) and the image holds neither.

- Taking one (warmstart/snapshot_take.py `take(lean=...)`): after the dump the serving engine refills its
  weights from the store's published snapshot files (`write_store_plan`: a plan naming them per local rank).
- Restoring one: the launcher restores the processes, stages the snapshot into /dev/shm as a staged start
  does, and has the restored engine refill from that plan (`refill`) while the files land; only then does it
  take requests. What is refilled is exactly what the capture holds (plugin/weight_refill.py).

A lean snapshot is restored only when this launch's plan stages the same source id (the key holds the source
id; the snapshot must be in the store); otherwise the engine starts as usual (one event). A refill that fails
stops the restored engine (it holds no weights) and the launcher starts the engine as usual.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

from mxlaunch.plan import Plan, RankFile
from mxlaunch.warmstart.engine_snapshot import SnapshotError
from mxlaunch.warmstart.snapshot_restore import RestoredEngine, _wake_restored

REFILL_PLAN = "refill-plan.json"


def lean_flags(argv: Sequence[str], extension: str) -> tuple[list[str], str]:
    """The flags a lean-snapshot start adds (vLLM: its worker extension), and why not ("" when it can):
    a command with a worker extension of its own keeps it, and its snapshot sleeps at level 1 instead."""
    if any(a == "--worker-extension-cls" or a.startswith("--worker-extension-cls=") for a in argv):
        return [], "the command sets its own --worker-extension-cls"
    return ["--worker-extension-cls", extension], ""


def store_plan(run_dir: Path, source_id: str, local_ranks: Sequence[dict], files_by_rank: dict[int, list[Any]],
               wait_timeout_s: float = 600.0) -> Plan:
    """A plan that points every local worker at its snapshot rank's files where they are (in the store):
    what the serving engine refills from after a lean snapshot was taken. `files_by_rank`: snapshot rank →
    files with .path and .bytes."""
    ranks = {str(w["rank"]): [RankFile(path=str(f.path), bytes=int(f.bytes))
                              for f in files_by_rank.get(int(w["snapshot_rank"]), [])] for w in local_ranks}
    return Plan(strategy="staged", source_id=source_id, run_dir=str(run_dir), ranks=ranks, wait_timeout_s=wait_timeout_s)


def blocker(store: Any) -> str:
    """Why a launch with this store cannot take a lean snapshot ("" when it can): its serving engine refills from
    the store's files in place, so the store must be a local folder."""
    return "the store is remote (S3): no file to refill from in place" if getattr(store, "remote", False) else ""


def write_store_plan(store: Any, launch: Any, run_dir: Path, wait_timeout_s: float) -> str:
    """Write the plan a lean snapshot's serving engine refills from — the store's published files of
    `launch.source_id`, per local rank of `launch` (a LaunchPlan) — into `run_dir`; its path. SnapshotError when
    the store holds no such snapshot (nothing is slept then)."""
    from mxlaunch.fileutil import write_json_atomic

    found = store.lookup(launch.source_id)
    if found.snapshot is None:
        raise SnapshotError(f"no snapshot in the store to refill the weights from: {found.reason}")
    ranks = sorted({w["snapshot_rank"] for w in launch.local_ranks})
    plan = store_plan(run_dir, launch.source_id, launch.local_ranks,
                      {r: found.snapshot.files_for_ranks([r]) for r in ranks}, wait_timeout_s)
    write_json_atomic(run_dir / REFILL_PLAN, plan.to_dict(), private=True)
    return str(run_dir / REFILL_PLAN)


def refill(engine: RestoredEngine, plan_file: Path) -> dict:
    """Have a restored lean engine refill its weights from `plan_file` and wake its KV cache; what it reported
    (seconds, per-rank bytes). SnapshotError when it could not — its weights are then unusable."""
    t0 = time.monotonic()
    seconds, result = _wake_restored(engine.meta, "refill", str(plan_file))
    ranks = result if isinstance(result, list) else []
    return {"refill_s": round(seconds, 3), "refill_bytes": sum(int(r.get("bytes", 0)) for r in ranks if isinstance(r, dict)),
            "ranks": len(ranks), "wall_s": round(time.monotonic() - t0, 3)}


def why_not_restore(meta: dict, strategy: str) -> Optional[str]:
    """Why a lean snapshot cannot serve this launch (None: it can): its weights come from the staged snapshot."""
    if meta.get("lean") and strategy != "staged":
        return f"a lean snapshot refills its weights from the staged snapshot, and this launch's plan is {strategy}"
    return None


__all__ = ["REFILL_PLAN", "SnapshotError", "blocker", "lean_flags", "refill", "store_plan", "why_not_restore",
           "write_store_plan"]
