"""Torch models for the P2P tests: a post-processing that packs two weights into one plain attribute
(like the engines' qkv packing) and keeps a view of it, a tied embedding, a buffer; sizes from tiny to
big enough that a pull takes several READ batches."""

from __future__ import annotations

import torch
from torch import nn


class Packed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.register_buffer("scale", torch.ones(dim))

    def post_process(self, variant: str = "") -> None:
        """Pack q and k (the other variant packs them the other way round: same names, other bytes)."""
        parts = [self.k.weight.data, self.q.weight.data] if variant == "swapped" else [self.q.weight.data, self.k.weight.data]
        self.qk = torch.cat(parts).contiguous()
        self.q_view = self.qk[: self.q.weight.shape[0]]
        if variant == "transposed":
            self.qk = self.qk.t().contiguous().t()


class PackedModel(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 1, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Packed(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def post_process(self, variant: str = "") -> None:
        for layer in self.layers:
            layer.post_process(variant)


SIZES = {"tiny": dict(dim=8, layers=1, vocab=16), "big": dict(dim=2048, layers=4, vocab=4096)}  # big: ~100 MiB f32


def build(seed: int, size: str = "tiny", *, post: bool = True, variant: str = "") -> PackedModel:
    torch.manual_seed(seed)
    model = PackedModel(**SIZES[size])
    if post:
        model.post_process(variant)
    return model


def checkpoint(seed: int, size: str = "tiny") -> dict[str, torch.Tensor]:
    """What a default loader would read: the seed's weights, before post-processing."""
    return {k: v.clone() for k, v in build(seed, size, post=False).state_dict().items()}
