"""The adapters' load step: the engine's own build → weights → post-processing, wrapped in what every
strategy needs around it (early pinning and NIXL start, the processed P2P pull, one rebuild after a
pull failed past the point of falling back in place, the loaded marker, serving as a P2P source)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from mxlaunch.plugin.p2p_prepare import prepare_p2p
from mxlaunch.plugin.rank_load import prepare_gpu
from mxlaunch.plugin.rank_markers import report_fallback
from mxlaunch.plugin.tensors import Reinitialise


def build_and_load(adapter: Any, build: Callable[[], Any], *, plan: Any, rank: int, log: logging.Logger,
                   engine: str, reset: Callable[[], None] = lambda: None) -> Any:
    """The adapters' load step around the engine's own build → weights → post-processing (`build`):
    early pinning and NIXL start, the processed P2P pull after post-processing, one rebuild with the
    engine's default loader when a pull failed past the point of falling back in place, then the loaded
    marker and P2P serving. `adapter` holds `_outcome`, `_rank_load` and `_force_default`; `reset` undoes
    what a first build registered in the engine (vLLM: its layer names)."""
    prepare_gpu(plan, rank, log)
    prepare_p2p(plan, rank, log)
    adapter._force_default = False
    try:
        model = build()
        if adapter._outcome is not None:
            adapter._rank_load.finish_p2p(adapter._outcome)
    except Reinitialise as exc:
        if plan is None or not plan.fallback_ok:
            raise RuntimeError(f"mxlaunch: rank {rank}: {exc} and the plan forbids falling back") from exc
        report_fallback(plan, rank, f"{exc}; building the model again with {engine}'s default loader", log, engine)
        model = None
        adapter._outcome = adapter._rank_load = None
        adapter._force_default = True
        reset()
        _free_device_memory()
        model = build()
    if adapter._outcome is not None:
        adapter._rank_load.write_loaded(adapter._outcome)
        adapter._rank_load.serve()
    return model


def effective_plan(adapter: Any, plan: Any) -> Any:
    """The plan a (re)build loads by: after a failed P2P pull, the engine's default."""
    if plan is not None and getattr(adapter, "_force_default", False):
        return dataclasses.replace(plan, strategy="default")
    return plan


def _free_device_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
