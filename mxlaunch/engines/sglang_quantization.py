"""SGLang's quantization methods that a raw snapshot cannot restore (issue 40; docs/quantized.md).

SGLang's quantized layers keep the checkpoint's tensors until post-processing (online fp8 included: the bf16 weight
stays until then), so the raw snapshot restores them. ModelOpt's checkpoints go through ModelOptModelLoader, which
loads an already quantized checkpoint as DefaultModelLoader does (the in-engine hook swaps it: plugin/sglang.py) but
runs ModelOpt's own quantize-while-loading workflow on an unquantized one. What is left is refused here, so that
the plan says `strategy=default` with the reason before the engine starts instead of a fallback after it started.
"""

from __future__ import annotations

from typing import Optional

from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import model_config
from mxlaunch.engines.quantization import checkpoint_quantized

_MODELOPT_ONLINE = ("modelopt", "modelopt_fp8", "modelopt_fp4", "modelopt_mixed")
_OWN_LOADER = {
    "auto-round-int8": "AutoRound INT8 loads through SGLang's own IncModelLoader",
    "bitsandbytes": "bitsandbytes models load through SGLang's own bitsandbytes loader (it quantizes while reading)",
}


def quantization_refusal(spec: LaunchSpec) -> Optional[str]:
    """Why this SGLang command's quantization cannot be restored from a snapshot (said in the plan), or None."""
    method = (spec.quantization or "").lower()
    stored = str((model_config(spec.model_path).get("quantization_config") or {}).get("quant_method", "")).lower()
    for name in (method, stored):
        if name in _OWN_LOADER:
            return f"--quantization {name}: {_OWN_LOADER[name]}; serving with the default loader"
    if method in _MODELOPT_ONLINE and not checkpoint_quantized(spec):
        return (f"--quantization {method} on an unquantized checkpoint: ModelOpt quantizes it while loading, which a "
                "snapshot cannot restore (a pre-quantized ModelOpt checkpoint is restored); serving with the default "
                "loader")
    return None


RAW_NOTE = ("the checkpoint's tensors as SGLang's weight loading leaves them (online fp8 keeps its bf16 weight until "
            "then); its post-processing runs after the restore")
