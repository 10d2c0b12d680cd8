"""SGLang adapter of the in-engine plugin: a hook around SGLang's loader factory.

SGLang calls the `sglang.srt.plugins` entry point `mxlaunch = "mxlaunch.plugin.sglang:register"` in
launch_server, the Engine and every scheduler process it spawns (schedulers start with `spawn`, so
nothing patched in the parent reaches them: the plan travels as MXLAUNCH_PLAN in the environment).
`register()` does nothing without MXLAUNCH_PLAN — a plain `sglang serve` is untouched. With a plan it
registers an AROUND hook on `sglang.srt.model_loader.loader.get_model_loader` through SGLang's
HookRegistry. SGLang keeps its stock `--load-format` (its enum rejects new names); the hook decides
what loads: when SGLang picked its DefaultModelLoader (auto/safetensors checkpoints) and the plan says
capture or staged, it hands back MxlaunchSGLangLoader, a DefaultModelLoader whose
`load_weights_and_postprocess` step is

    capture  SGLang's own weight loading, then this rank's raw tensors → <capture_dir>/<rank>/part-*.safetensors
             (before post-processing), marker captured-<rank>
    staged   wait for each file of this rank, copy its tensors in by name, check the fill
    then     SGLang's post-processing (quant repacking, AMX packing) as usual

and `load_model` writes marker loaded-<rank> afterwards. ModelOptModelLoader on an already quantized
checkpoint loads as DefaultModelLoader does and is swapped too (`loads_as_default`). Any other loader SGLang
picked (GGUF, sharded_state, ModelOpt's quantize-while-loading, ...) is left alone and the rank reports a fallback. With
`--snapshot-format sharded_state|presharded` the snapshot is SGLang's own dump instead
(plugin/sglang_sharded.py).

**Rank** = dp_rank·(TP·PP) + SGLang's world rank (tp_size·pp_rank + tp_rank, `spawn_world_rank`); DP
replicas are separate worlds in SGLang, attention-DP is not a replica (dp_rank counts as 0 there).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mxlaunch.contract import PRESHARDED, SHARDED_STATE
from mxlaunch.plan import PLAN_ENV

TARGET = "sglang.srt.model_loader.loader.get_model_loader"
log = logging.getLogger("sglang.mxlaunch")

_loader_cls: type | None = None


def register() -> None:
    """The sglang.srt.plugins entry point; never raises (a plugin must not take SGLang down)."""
    from mxlaunch.plugin import snapshot_signal

    snapshot_signal.install()
    if not os.environ.get(PLAN_ENV):
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGET, around_get_model_loader, HookType.AROUND)
    except Exception as exc:  # noqa: BLE001
        log.warning("mxlaunch: could not hook SGLang's loader factory: %s", exc)


def around_get_model_loader(original: Any, load_config: Any, model_config: Any = None) -> Any:
    """SGLang's choice of loader, swapped for ours when the plan asks for capture, staged or p2p."""
    loader = original(load_config, model_config)
    from mxlaunch.plan import PlanError, load_plan

    try:
        plan = load_plan()
    except PlanError as exc:
        log.warning("mxlaunch: SGLang's default loader serves this rank: %s", exc)
        return loader
    if plan is None or plan.strategy not in ("capture", "staged", "p2p"):
        return loader
    from sglang.srt.model_loader.loader import DefaultModelLoader

    rank = global_rank()  # once per loader: the adapters below take it as given
    if type(loader) is not DefaultModelLoader and not loads_as_default(loader, model_config):
        from mxlaunch.plugin.rank_markers import report_fallback

        report_fallback(plan, rank, f"SGLang chose {type(loader).__name__} for this checkpoint; mxlaunch restores "
                                    "only what DefaultModelLoader loads", log)
        return loader
    if plan.snapshot_format == SHARDED_STATE:
        from mxlaunch.plugin.sglang_sharded import sharded_loader

        return sharded_loader(load_config, plan, rank, original=loader)
    if plan.snapshot_format == PRESHARDED:
        from mxlaunch.plugin.sglang_sharded import presharded_loader

        return presharded_loader(load_config, plan, rank, original=loader)
    return loader_class()(load_config, plan, rank)


def loads_as_default(loader: Any, model_config: Any) -> bool:
    """True when SGLang's choice loads exactly as DefaultModelLoader does, so mxlaunch's loader may stand in.

    SGLang picks ModelOptModelLoader for every ModelOpt checkpoint (FP8, NVFP4, mixed: the common pre-quantized
    checkpoints on the Hub); on one that is already quantized its `load_model` is DefaultModelLoader's, and only the
    quantize-while-loading workflow of an unquantized one is its own (refused in the plan, engines/sglang_engine.py)."""
    if type(loader).__name__ != "ModelOptModelLoader":
        return False
    already = getattr(model_config, "_is_already_quantized", None)
    try:
        return bool(already()) if callable(already) else False
    except Exception:  # noqa: BLE001 — an SGLang that cannot tell: leave its loader alone
        return False


def global_rank() -> int:
    """This scheduler's key in the plan (see the module docstring)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        tp_size, pp_size = int(par.tp_size), int(par.pp_size)
        world = tp_size * int(par.pp_rank) + int(par.tp_rank)
        try:
            dp_rank = 0 if par.attn_dp_enabled else int(par.dp_rank or 0)
        except Exception:  # noqa: BLE001 — not published: a single replica
            dp_rank = 0
        return dp_rank * tp_size * pp_size + world
    except Exception:  # noqa: BLE001
        pass
    from mxlaunch.plugin.rank_load import distributed_rank

    rank = distributed_rank()
    return 0 if rank is None else rank


def _layout() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        for key in ("tp_rank", "pp_rank", "dp_rank"):
            try:
                value = getattr(par, key)
                if value is not None:
                    out[key] = int(value)
            except Exception:  # noqa: BLE001
                pass
    except Exception:  # noqa: BLE001
        pass
    return out


def loader_class() -> type:
    """Build (once) the DefaultModelLoader subclass; SGLang is imported only here, inside the engine."""
    global _loader_cls
    if _loader_cls is not None:
        return _loader_cls

    from sglang.srt.model_loader.loader import DefaultModelLoader, device_loading_context

    from mxlaunch.plugin import sglang_weight_steps
    from mxlaunch.plugin.load_step import build_and_load, effective_plan
    from mxlaunch.plugin.rank_load import RankLoad

    class MxlaunchSGLangLoader(DefaultModelLoader):
        """SGLang's DefaultModelLoader with the weight step taken from the plan (capture or staged)."""

        def __init__(self, load_config: Any, plan: Any, rank: int) -> None:
            super().__init__(load_config)
            self._plan = plan
            self._rank = rank
            self._rank_load: Any = None
            self._outcome: Any = None
            self._force_default = False

        def download_model(self, model_config: Any) -> None:
            if self._plan.strategy in ("staged", "p2p"):
                return  # the weights come from the snapshot; a fallback reads the checkpoint then
            super().download_model(model_config)

        def load_model(self, *, model_config: Any, device_config: Any) -> Any:
            self._outcome = None
            return build_and_load(
                self, lambda: super(MxlaunchSGLangLoader, self).load_model(model_config=model_config,
                                                                           device_config=device_config),
                plan=self._plan, rank=self._rank, log=log, engine="SGLang")

        def load_weights_and_postprocess(self, model: Any, weights: Any, target_device: Any) -> None:
            # DefaultModelLoader.load_model calls this through self; `weights` is a lazy iterator over
            # the checkpoint that a staged restore never starts (no checkpoint reads).
            def default_load() -> None:
                sglang_weight_steps.load_only(DefaultModelLoader, model, weights, target_device)

            self._rank_load = RankLoad(model, effective_plan(self, self._plan), self._rank, default_load, engine="SGLang", log=log,
                                       layout=_layout)
            self._outcome = self._rank_load.run()
            sglang_weight_steps.postprocess(DefaultModelLoader, model, target_device, device_loading_context)

    MxlaunchSGLangLoader.__module__ = __name__
    MxlaunchSGLangLoader.__qualname__ = "MxlaunchSGLangLoader"
    _loader_cls = MxlaunchSGLangLoader
    return _loader_cls


__all__ = ["TARGET", "around_get_model_loader", "global_rank", "loader_class", "register"]
