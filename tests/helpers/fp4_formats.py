"""NVFP4 checkpoints in compressed-tensors' `nvfp4-pack-quantized` format, written in code (issue 40).

What llm-compressor writes for W4A4 NVFP4 (and vLLM's CompressedTensorsW4A4Fp4 loads): per Linear a `weight_packed`
uint8 [out, in/2] of two E2M1 codes a byte (the even column in the low nibble), a `weight_scale` float8_e4m3fn
[out, in/16] (one scale per 16 inputs, stored multiplied by the global scale), and float32 `weight_global_scale`
and `input_global_scale` of one element, both as divisors (448·6/amax). One global weight scale serves the whole
model here, so q/k/v and gate/up share theirs as vLLM's fused layers want.

MXFP4 (OCP microscaling, compressed-tensors' `mxfp4-pack-quantized`, vLLM's CompressedTensorsW4A4Mxfp4) packs the
same E2M1 codes with no global scale: one uint8 E8M0 `weight_scale` per 32 inputs, the power of two 2^(e-127).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open

GROUP = 16
MX_GROUP = 32  # MXFP4's group: one E8M0 scale per 32 inputs
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the magnitudes of codes 0..7 (bit 3: the sign)
FP8_MAX, FP4_MAX = 448.0, 6.0
INPUT_AMAX = 8.0  # the activations' assumed range: input_global_scale = 448·6/8


def config() -> dict:
    """compressed-tensors' quantization_config for W4A4 NVFP4 (weights static, activations dynamic per group)."""
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP, "strategy": "tensor_group",
            "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**args, "dynamic": False},
                                          "input_activations": {**args, "dynamic": "local"},
                                          "output_activations": None}}}


def model_amax(shards: Iterable[Path], is_linear: Callable[[str], bool]) -> float:
    """The largest |w| over every Linear weight of the model: its one global scale is 448·6 over this."""
    amax = 0.0
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if is_linear(name):
                    amax = max(amax, float(f.get_tensor(name).float().abs().max()))
    return max(amax, 1e-8)


def nvfp4(w: torch.Tensor, amax: float) -> dict[str, torch.Tensor]:
    """w [out, in] (in % 16 == 0) → the four NVFP4 tensors of one Linear, under the global scale of `amax`."""
    w = w.float()
    out, inp = w.shape
    glob = FP8_MAX * FP4_MAX / amax
    groups = w.view(out, inp // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2) / FP4_MAX * glob).to(torch.float8_e4m3fn)
    x = groups / (scale.float() / glob).clamp(min=1e-12)[:, :, None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)
    pairs = code.view(out, inp // 2, 2)
    return {"weight_packed": (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8),
            "weight_scale": scale,
            "weight_global_scale": torch.tensor([glob], dtype=torch.float32),
            "input_global_scale": torch.tensor([FP8_MAX * FP4_MAX / INPUT_AMAX], dtype=torch.float32)}


def mxfp4_config() -> dict:
    """compressed-tensors' MXFP4 preset (its quant_scheme.MXFP4): E2M1 weights and activations in groups of 32,
    E8M0 (uint8) scales; the activations dynamic."""
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": MX_GROUP, "strategy": "group",
            "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8", "block_structure": None, "actorder": None,
            "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**args, "dynamic": False},
                                          "input_activations": {**args, "dynamic": True},
                                          "output_activations": None}}}


def mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [out, in] (in % 32 == 0) → MXFP4's `weight_packed` (E2M1 pairs, the even column low) and `weight_scale`
    (uint8 E8M0: the smallest power of two that brings the group's largest |w| within E2M1's 6)."""
    w = w.float()
    out, inp = w.shape
    groups = w.view(out, inp // MX_GROUP, MX_GROUP)
    exponent = torch.ceil(torch.log2(groups.abs().amax(dim=2).clamp(min=2.0 ** -120) / FP4_MAX)).clamp(-127, 127)
    x = groups / torch.exp2(exponent)[:, :, None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)
    pairs = code.view(out, inp // 2, 2)
    return {"weight_packed": (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8),
            "weight_scale": (exponent + 127).to(torch.uint8)}


def modelopt_config() -> dict:
    """NVIDIA ModelOpt's NVFP4 config as its config.json carries it (flat; `ignore`, not hf_quant_config.json's
    `exclude_modules`)."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP, "kv_cache_scheme": None,
            "ignore": ["lm_head"], "producer": {"name": "modelopt"}}


def modelopt_nvfp4(w: torch.Tensor, amax: float) -> dict[str, torch.Tensor]:
    """The same NVFP4 values under ModelOpt's names: `weight` (packed), `weight_scale` (e4m3, per 16), and the
    global scales as multipliers — `weight_scale_2` = amax/(448·6), `input_scale` likewise for the activations."""
    ct = nvfp4(w, amax)
    return {"weight": ct["weight_packed"], "weight_scale": ct["weight_scale"],
            "weight_scale_2": 1.0 / ct["weight_global_scale"], "input_scale": 1.0 / ct["input_global_scale"]}
