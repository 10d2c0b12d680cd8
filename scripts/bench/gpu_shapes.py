"""Synthetic Llama-70B rank tensors on the GPU, shared by the GPU benchmarks (bench_gpu_load.py,
bench_gpu_two_ranks.py) so that neither imports the other."""

from __future__ import annotations

import torch


def rank_tensors(layers: int, device: str = "cuda", tp: int = 4) -> list[tuple[str, torch.Tensor]]:
    """Llama-70B rank shapes at tensor parallelism `tp` (hidden 8192, 64 query / 8 KV heads of 128, FFN 28672,
    vocab 128256; KV heads replicate past tp 8): tp 4 is 12.14 GiB for 28 layers, 32.9 GiB for all 80."""
    h, q, kv, ffn, vocab = 8192, 8192 // tp, max(1024 // tp, 128), 28672 // tp, 128256 // tp
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_up_proj.weight", (2 * ffn, h)), (p + "mlp.down_proj.weight", (h, ffn)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    gen = torch.Generator(device=device).manual_seed(0)
    return [(n, torch.randn(s, dtype=torch.bfloat16, device=device, generator=gen)) for n, s in out]
