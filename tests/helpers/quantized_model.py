"""Tiny pre-quantized checkpoints, written in code from a tiny model (tests/helpers/tiny_model.py).

    quantize_model(src_dir, out_dir, method)    # method: one of METHODS
    cached_quantized(cache_root, method)        # the seed-0 tiny model, quantized once per generator version

The formats are written by hand, as their producers lay them out (no quantization library needed):

- ``w8a8-int8``: compressed-tensors "int-quantized": each Linear's ``weight`` int8 [out, in], symmetric
  per output channel, ``weight_scale`` [out, 1]; activations int8 per token, dynamic (no input scales).
- ``w8a8-fp8``: compressed-tensors "float-quantized": ``weight`` float8_e4m3fn, per-channel ``weight_scale``
  [out, 1], dynamic per-token fp8 activations.
- ``awq``: AutoAWQ GEMM, 4 bit, group 32, zero point: ``qweight`` int32 [in, out/8] (nibbles in AWQ's order
  0 2 4 6 1 3 5 7), ``qzeros`` int32 [in/32, out/8] (same order), ``scales`` fp16 [in/32, out].
- ``w8a8-int8-kvfp8``: ``w8a8-int8`` plus a compressed-tensors fp8 ``kv_cache_scheme`` and per-tensor
  ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (serve with ``--kv-cache-dtype fp8``).
- ``gptq``: AutoGPTQ, 4 bit, group 32, symmetric, no act-order: ``qweight`` int32 [in/8, out] (packed along
  the input), ``qzeros`` int32 [in/32, out/8] (stored zero - 1 = 7), ``scales`` fp16 [in/32, out], ``g_idx``.
- ``gptq-act-order``: ``gptq`` with ``desc_act: true``: the inputs grouped in a permuted order (``g_idx[i]``,
  one permutation per input width, as q/k/v and gate/up share theirs), ``qweight`` in the inputs' own order.
- ``block-fp8``: DeepSeek-V3 / Qwen3-FP8's block-wise FP8 (vLLM's "fp8" method with ``weight_block_size``):
  ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)], one per
  128×128 block — the factor that dequantizes (w ≈ weight · weight_scale_inv), despite its name; dynamic
  activations (vLLM quantizes them per token group of 128; on Hopper it takes DeepGEMM's JIT kernels).
- ``nvfp4``: compressed-tensors "nvfp4-pack-quantized" (W4A4 NVFP4; tests/helpers/fp4_formats.py);
  ``modelopt-nvfp4``: the same values as NVIDIA ModelOpt writes them (``weight``, ``weight_scale``, ``weight_scale_2``,
  ``input_scale``; ``quant_method: modelopt``, ``quant_algo: NVFP4``).
- ``modelopt-fp8``: NVIDIA ModelOpt's FP8 (``quant_algo: FP8``, the nvidia/*-FP8 checkpoints on the Hub): ``weight``
  float8_e4m3fn, one float32 ``weight_scale`` per tensor, a static float32 ``input_scale``.
- ``mxfp4``: compressed-tensors "mxfp4-pack-quantized" (OCP MXFP4: E2M1 pairs, a uint8 E8M0 scale per 32 inputs,
  no global scale; vLLM's CompressedTensorsW4A4Mxfp4 — Marlin W4A16 on Hopper).

Only the decoder layers' Linears are quantized; embeddings, norms and lm_head stay as they are.

``mixtral_from_llama`` makes a tiny random Mixtral with the tiny Llama's tokenizer (hidden 128, EXPERTS
experts ``block_sparse_moe.experts.E.w1/w2/w3``, a router ``gate``, top 2; hidden, intermediate, layers and
experts can be set, e.g. GPU_MOE for the GPU harness);
``cached_quantized(..., moe=True)`` quantizes that instead (the router stays float, as vLLM builds it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers import fp4_formats
from tests.helpers.tiny_model import cached_model

METHODS = ("w8a8-int8", "w8a8-fp8", "awq", "gptq", "gptq-act-order", "w8a8-int8-kvfp8", "block-fp8", "nvfp4", "modelopt-nvfp4", "modelopt-fp8", "mxfp4")
KV_SCALES = {"k": 0.03125, "v": 0.0625}  # per-tensor fp8 KV-cache scales written for "w8a8-int8-kvfp8"
GROUP = 32
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
EXPERTS = 4
MOE_HIDDEN = 128
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the nibble k of a packed int32 holds column AWQ_ORDER[k]
BLOCK = 128  # block-fp8: DeepSeek-V3's 128×128 weight blocks (DeepGEMM's tile)
# A Mixtral for the GPU harness (scripts/bench/gpu_engine_e2e.py --moe), from the 8 GiB Llama's attention shapes:
# 8 experts, top 2, hidden 4096, expert width 1408 (11·128: the block-fp8 shape rule holds too), 12 layers —
# ~4.1 GiB in bf16, ~2.1 GiB in fp8; fused-MoE GEMMs of [2816 × 4096] per expert, large enough to run for real.
GPU_MOE = {"experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 1408, "layers": 12}


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in _LINEARS)


def _ct_config(kind: str) -> dict:
    """compressed-tensors' quantization_config for W8A8 (int or float), channel-wise weights, dynamic tokens."""
    args = {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None, "block_structure": None,
            "observer": "minmax", "observer_kwargs": {}, "actorder": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"],  # the MoE router stays float
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**args, "strategy": "channel", "dynamic": False},
            "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
    }


def _w8(w: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8)
    if kind == "int":
        scale = amax / 127.0
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    else:
        scale = amax / torch.finfo(torch.float8_e4m3fn).max
        q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.to(torch.float32)}


def _modelopt_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt's per-tensor FP8: one dequantization factor for the whole weight (amax / 448), and a static
    activation scale (here the weight's, a stand-in for calibration)."""
    w = w.float()
    scale = (w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(()).to(torch.float32),
            "input_scale": scale.reshape(()).to(torch.float32).clone()}


def _block_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [out, in] → e4m3 weight and one float32 dequantization factor per BLOCK×BLOCK block (edges padded)."""
    w = w.float()
    out, inp = w.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:out, :inp] = w
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)[:out, :inp]
    return {"weight": q.to(torch.float8_e4m3fn).contiguous(), "weight_scale_inv": scale.contiguous()}


def _pack_cols(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, cols] of 4-bit values → int32 [rows, cols/8], nibble k from column 8j + order[k]."""
    rows, cols = q.shape
    q = q.to(torch.int64).view(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for k, col in enumerate(order):
        packed |= q[:, :, col] << (4 * k)
    return _int32(packed)


def _int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _int4_groups(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] → (q [in, out] in 0..15, scales [in/G, out], zeros [in/G, out]) per group of G inputs."""
    wt = w.float().t().contiguous()  # [in, out]
    groups = wt.view(wt.shape[0] // GROUP, GROUP, wt.shape[1])
    if symmetric:
        scale = (groups.abs().amax(dim=1) / 7.0).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = groups.amin(dim=1), groups.amax(dim=1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(groups / scale[:, None, :] + zero[:, None, :]).clamp(0, 15)
    return q.view_as(wt), scale, zero


def _awq(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale, zero = _int4_groups(w, symmetric=False)
    return {"qweight": _pack_cols(q, _AWQ_ORDER), "qzeros": _pack_cols(zero, _AWQ_ORDER),
            "scales": scale.to(torch.float16)}


def _gptq(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale, zero = _int4_groups(w, symmetric=True)
    rows = q.t().contiguous()  # pack along the input: [out, in] → [out, in/8] → transposed [in/8, out]
    qweight = _pack_cols(rows, tuple(range(8))).t().contiguous()
    return {"qweight": qweight, "qzeros": _pack_cols(zero - 1, tuple(range(8))),
            "scales": scale.to(torch.float16),
            "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // GROUP}


def _gptq_act_order(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ with act-order (`desc_act: true`, most AutoGPTQ checkpoints): the inputs are grouped in a permuted
    order — `g_idx[i]` is input i's group — while `qweight` keeps the inputs in their own order. vLLM's Marlin
    sorts by g_idx after loading (`g_idx_sort_indices`, weights permuted): state the checkpoint does not have."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[1]))
    g_idx = torch.empty(w.shape[1], dtype=torch.int32)
    g_idx[perm] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
    q_perm, scale, zero = _int4_groups(w[:, perm], symmetric=True)  # groups of GROUP consecutive permuted inputs
    q = torch.empty_like(q_perm)
    q[perm] = q_perm  # back to the inputs' own order
    qweight = _pack_cols(q.t().contiguous(), tuple(range(8))).t().contiguous()
    return {"qweight": qweight, "qzeros": _pack_cols(zero - 1, tuple(range(8))), "scales": scale.to(torch.float16),
            "g_idx": g_idx}


def _quant_config(method: str) -> dict:
    if method == "w8a8-int8":
        return _ct_config("int")
    if method == "w8a8-int8-kvfp8":
        return {**_ct_config("int"), "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "dynamic": False, "symmetric": True}}
    if method == "w8a8-fp8":
        return _ct_config("float")
    if method == "block-fp8":  # as DeepSeek-V3's config.json has it
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if method in ("gptq", "gptq-act-order"):
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": method == "gptq-act-order",
                "sym": True, "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
    if method == "nvfp4":
        return fp4_formats.config()
    if method == "modelopt-nvfp4":
        return fp4_formats.modelopt_config()
    if method == "modelopt-fp8":  # config.json's flat form, as ModelOpt's HF export writes it
        return {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": None, "ignore": ["lm_head"],
                "producer": {"name": "modelopt"}}
    if method == "mxfp4":
        return fp4_formats.mxfp4_config()
    raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")


def quantize_model(src: Path, out: Path, method: str) -> Path:
    """Write `src` (a float model folder: one model.safetensors, or shards with their index) quantized by
    `method` into `out`, shard by shard under the same file names; returns `out`."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quant_config(method)
    dtype = torch.float16 if method in ("awq", "gptq", "gptq-act-order") else torch.bfloat16
    config["torch_dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float16"
    amax = fp4_formats.model_amax(sorted(src.glob("*.safetensors")), _is_linear) if "nvfp4" in method else 0.0
    convert = {"w8a8-int8": lambda w: _w8(w, "int"), "w8a8-int8-kvfp8": lambda w: _w8(w, "int"), "w8a8-fp8": lambda w: _w8(w, "float"),
               "awq": _awq, "gptq": _gptq, "gptq-act-order": _gptq_act_order, "block-fp8": _block_fp8, "nvfp4": lambda w: fp4_formats.nvfp4(w, amax),
               "modelopt-nvfp4": lambda w: fp4_formats.modelopt_nvfp4(w, amax), "modelopt-fp8": _modelopt_fp8,
               "mxfp4": fp4_formats.mxfp4}[method]
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for name, t in load_file(str(shard)).items():
            if _is_linear(name):
                stem = name[: -len("weight")]
                tensors.update({stem + k: v.contiguous() for k, v in convert(t).items()})
                if method.endswith("-kvfp8") and (".k_proj." in name or ".v_proj." in name):
                    kv = "k" if ".k_proj." in name else "v"  # vLLM maps self_attn.k_proj.k_scale → attn.k_scale
                    tensors[f"{stem}{kv}_scale"] = torch.tensor(KV_SCALES[kv], dtype=torch.float32)
            else:
                tensors[name] = t.to(dtype).contiguous()
        save_file(dict(sorted(tensors.items())), str(out / shard.name), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in tensors})
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy2(f, out / f.name)
    index = src / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = dict(sorted(weight_map.items()))
        doc.setdefault("metadata", {})["total_size"] = sum((out / n).stat().st_size for n in set(weight_map.values()))
        (out / index.name).write_text(json.dumps(doc, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def wide_llama(src: Path, out: Path, hidden: int = 256, inter: int = 384, heads: int = 2, kv: int = 1,
               head_dim: int = 128) -> Path:
    """A one-layer random Llama with the tiny model's tokenizer and every Linear a multiple of BLOCK wide
    (block-fp8 needs it; the tiny Llama's 64-wide k/v projections are not)."""
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=head_dim, num_hidden_layers=1, torch_dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)

    pre, ones = "model.layers.0.", torch.ones(hidden, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden), "model.norm.weight": ones,
               "lm_head.weight": rand(config["vocab_size"], hidden), pre + "input_layernorm.weight": ones.clone(),
               pre + "post_attention_layernorm.weight": ones.clone(),
               pre + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
               pre + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
               pre + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
               pre + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
               pre + "mlp.gate_proj.weight": rand(inter, hidden), pre + "mlp.up_proj.weight": rand(inter, hidden),
               pre + "mlp.down_proj.weight": rand(hidden, inter)}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config))
    return out


def mixtral_from_llama(src: Path, out: Path, experts: int = EXPERTS, top_k: int = 2, seed: int = 0,
                       hidden: int = MOE_HIDDEN, intermediate: int | None = None, layers: int | None = None) -> Path:
    """A random Mixtral with the float Llama folder `src`'s tokenizer, vocabulary and heads: hidden size `hidden`
    (MOE_HIDDEN by default: vLLM's CPU int4 MoE kernel takes only hidden % 128 == 0), each expert `intermediate`
    wide (default: hidden), `layers` layers (default: the Llama's); byte-identical per seed and sizes."""
    src, out = Path(src), Path(out)
    gen = torch.Generator().manual_seed(seed)
    config = json.loads((src / "config.json").read_text())
    h, inter, heads, kv, hd = hidden, intermediate or hidden, config["num_attention_heads"], \
        config["num_key_value_heads"], config["head_dim"]
    if layers:
        config["num_hidden_layers"] = layers
    std = 0.08 * (MOE_HIDDEN / h) ** 0.5  # the tiny model's 0.08 at hidden 128; wider layers keep their outputs' scale
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=h,
                  intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k,
                  router_aux_loss_coef=0.02, output_router_logits=False, sliding_window=None,
                  router_jitter_noise=0.0, torch_dtype="bfloat16")
    for key in ("mlp_bias", "pretraining_tp"):
        config.pop(key, None)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], h), "lm_head.weight": rand(config["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        tensors.update({pre + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                        pre + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                        pre + "self_attn.q_proj.weight": rand(heads * hd, h),
                        pre + "self_attn.k_proj.weight": rand(kv * hd, h),
                        pre + "self_attn.v_proj.weight": rand(kv * hd, h),
                        pre + "self_attn.o_proj.weight": rand(h, heads * hd),
                        pre + "block_sparse_moe.gate.weight": rand(experts, h) * 8})
        for e in range(experts):
            moe = f"{pre}block_sparse_moe.experts.{e}."
            tensors.update({moe + "w1.weight": rand(inter, h), moe + "w3.weight": rand(inter, h),
                            moe + "w2.weight": rand(h, inter)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def cached_quantized(cache_root: Path, method: str | None, seed: int = 0, moe: bool = False) -> Path:
    """The tiny model of `seed` (as a Mixtral when `moe`), quantized by `method` (None: float), made once per
    version of this file and fp4_formats.py."""
    cache_root = Path(cache_root)
    src = cached_model(cache_root, seed=seed)
    digest = hashlib.sha256(Path(__file__).read_bytes() + Path(fp4_formats.__file__).read_bytes()).hexdigest()[:12]
    out = cache_root / f"{src.name}{'-moe' if moe else ''}-{method or 'float'}-{digest}"
    with open(cache_root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            if moe:
                base = tmp.with_name(tmp.name + ".float")
                shutil.rmtree(base, ignore_errors=True)
                mixtral_from_llama(src, base if method else tmp, seed=seed)
                if method:
                    quantize_model(base, tmp, method)
                    shutil.rmtree(base)
            else:
                quantize_model(src, tmp, method)
            tmp.rename(out)
    return out
