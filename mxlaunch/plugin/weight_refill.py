"""Refill a sleeping engine's weights from a snapshot: the lean engine snapshot's other half.

Why: an engine snapshot that holds the weights (and the KV cache) is tens of GiB and restores at the disk's
speed (~1.8 GB/s on the H200 machine), while the same weights already sit in the artifact store or, staged,
in /dev/shm, from where the pinned path copies them at the link's speed. So a lean snapshot is taken with
vLLM asleep at level 2 (weights and KV cache discarded, their virtual addresses kept, so the CUDA graphs stay
valid), and a restore wakes the weights' memory and refills it here, then wakes the KV cache.

What is refilled is what the capture holds: the model's parameters and persistent buffers after the engine's
post-processing (plugin/loader.py `module_tensors`) — the layout the sleeping model still has, quantized
layouts (FP8 scales, Marlin repacks) included — so nothing is loaded or quantized again. The restore is the
staged path's (`restore_tensors`: every storage filled exactly once with the file's shape and dtype, files
awaited as they land); the rank's "loaded" marker then tells the launcher its staged files may go.

The seam is vLLM's own `--worker-extension-cls`: `WeightRefill` is mixed into its worker class, and the API
server calls `collective_rpc("mxlaunch_refill", args=(plan,))` (plugin/snapshot_signal.py) — a method name,
nothing pickled. Torch is imported only when a refill runs, inside the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mxlaunch.contract import REFILL_METHOD
from mxlaunch.plan import load_plan

log = logging.getLogger("mxlaunch.plugin")

EXTENSION = "mxlaunch.plugin.weight_refill.WeightRefill"  # the value of --worker-extension-cls
METHOD = REFILL_METHOD  # the name the API server calls (mxlaunch/contract.py)


class RefillError(RuntimeError):
    """The weights could not be refilled: the engine holds no usable weights and must not serve."""


def refill(model: Any, plan_path: str, rank: int) -> dict:
    """Copy rank `rank`'s files named by the plan at `plan_path` into `model`'s tensors; what was copied.
    Raises RefillError (the model's weights are then unusable: the caller stops the engine)."""
    from mxlaunch.plugin.loader import RestoreError, module_tensors, restore_tensors
    from mxlaunch.plugin.rank_markers import safe_marker

    plan = load_plan(plan_path)
    if plan is None:
        raise RefillError(f"no plan at {plan_path}")
    files = plan.files_for_rank(rank)
    if not files:
        raise RefillError(f"the plan {plan_path} lists no files for rank {rank}")
    started = time.perf_counter()
    try:
        result = restore_tensors(module_tensors(model), [(f.path, f.bytes) for f in files],
                                 wait_timeout_s=plan.wait_timeout_s)
    except RestoreError as exc:
        raise RefillError(f"rank {rank}: refilling the weights failed: {exc}") from exc
    done = {"rank": rank, "bytes": result.bytes, "tensors": result.tensors, "files": result.files,
            "seconds": round(time.perf_counter() - started, 4), "wait_seconds": round(result.wait_seconds, 4)}
    log.info("mxlaunch: rank %d refilled %.2f GiB of weights in %.3f s (lean engine snapshot)", rank,
             result.bytes / 2**30, done["seconds"])
    safe_marker(plan, "loaded", rank, {"bytes": result.bytes, "seconds": done["seconds"], "strategy": "refill"}, log)
    return done


class WeightRefill:
    """vLLM worker extension (--worker-extension-cls): the one method the API server calls on every worker."""

    def mxlaunch_refill(self, plan_path: str) -> dict:
        from mxlaunch.plugin.vllm import global_rank

        worker: Any = self
        return refill(worker.model_runner.model, plan_path, global_rank(worker.vllm_config))
