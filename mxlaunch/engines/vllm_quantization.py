"""vLLM's quantization methods that a raw snapshot cannot restore (issue 40; docs/quantized.md).

Pre-quantized checkpoints (compressed-tensors, fp8, AWQ, GPTQ, ...) load their tensors as stored and convert them in
post-processing: the raw snapshot restores them. Online fp8 is restored through its processed layout
(plugin/vllm_online_quant.py). What is left is refused here, so that the plan says `strategy=default` with the
reason before the engine starts instead of a restore that fails after it started.
"""

from __future__ import annotations

from typing import Optional

from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import model_config

_VLLM_OWN_LOADER = {
    "bitsandbytes": "bitsandbytes models load through vLLM's own bitsandbytes loader (it quantizes while reading)",
    "gguf": "GGUF checkpoints load through vLLM's own GGUF loader",
    "torchao": "torchao quantizes through its own load and reload path, not verified with snapshots",
}
_VLLM_ONLINE_FP8 = ("fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
_VLLM_ONLINE_OTHER = ("online", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8", "mxfp4")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def quantization_refusal(spec: LaunchSpec) -> Optional[str]:
    """Why this vLLM command's quantization cannot be restored from a snapshot (said in the plan, before the run),
    or None."""
    config = model_config(spec.model_path)
    stored = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    method = (spec.quantization or "").lower()
    for name in (method, stored):
        if name in _VLLM_OWN_LOADER:
            return f"--quantization {name}: {_VLLM_OWN_LOADER[name]}; serving with the default loader"
    if not _online(spec):
        return None
    if method not in _VLLM_ONLINE_FP8:
        return (f"--quantization {method}: online quantization other than fp8 is not restorable from a snapshot yet "
                "(issue 40); serving with the default loader")
    if any(config.get(k) for k in _MOE_KEYS) or any((config.get("text_config") or {}).get(k) for k in _MOE_KEYS):
        return (f"--quantization {method} on a mixture-of-experts model: its experts' online quantization is not "
                "restorable from a snapshot yet (issue 40); serving with the default loader")
    return None


def _online(spec: LaunchSpec) -> str:
    """The --quantization method when vLLM quantizes online (named by the flag, none in the checkpoint), else ""."""
    stored = (model_config(spec.model_path).get("quantization_config") or {}).get("quant_method")
    method = (spec.quantization or "").lower()
    return method if method in _VLLM_ONLINE_FP8 + _VLLM_ONLINE_OTHER and not stored else ""


def online_processed(spec: LaunchSpec) -> Optional[str]:
    """Why this command's model is restored through its processed layout (vLLM's online fp8), or None."""
    method = _online(spec)
    if method in _VLLM_ONLINE_FP8:
        return (f"--quantization {method} quantizes while loading: the restore brings each layer to its fp8 layout on "
                "placeholders on the device, then lands the snapshot over it (plugin/vllm_online_quant.py)")
    return None


RAW_NOTE = ("the checkpoint's tensors as vLLM's weight loading leaves them; its post-processing (repacking for the "
            "kernels) runs after the restore")
