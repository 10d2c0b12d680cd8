"""The P2P manifest and its exact match: what a target refuses before any byte moves (real torch models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxlaunch.plugin.p2p_source import keep_raw
from mxlaunch.plugin.tensors import LayoutMismatch, group_tensors
from mxlaunch.transfer.regions import region_index, regions_for
from mxlaunch.transfer.tensor_set import byte_view, describe, match, processed_tensors, span_bytes

pytestmark = pytest.mark.unit


class Packed(nn.Module):
    """A layer whose post-processing packs q and k into one tensor attached as a plain attribute, with
    a view of it kept as another attribute (like qkv packing in the engines)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8, bias=False)
        self.k = nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.ones(8))

    def post_process(self) -> None:
        self.qk = torch.cat([self.q.weight.data, self.k.weight.data]).contiguous()
        self.q_view = self.qk[:8]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layer = Packed()
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied

    def post_process(self) -> None:
        self.layer.post_process()


def _model(seed: int, post: bool = True) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny()
    if post:
        m.post_process()
    return m


def test_processed_tensors_include_attached_tensors_and_views() -> None:
    names = [n for n, _ in processed_tensors(_model(0))]
    assert "layer.qk" in names and "layer.q_view" in names
    assert "head.weight" in names and "embed.weight" in names and "layer.scale" in names


def test_match_pairs_every_byte_once_and_merges_overlapping_views() -> None:
    src, dst = _model(0), _model(1)
    manifest = describe(group_tensors(processed_tensors(src)))
    pairs = match(processed_tensors(dst), manifest)
    # q_view lies inside qk: one copy covers both; the tie is one group
    assert sum(p.bytes for p in pairs) == sum(span_bytes(g.tensor) for g in group_tensors(processed_tensors(dst))) - 8 * 8 * 4
    # doing the copies by address reproduces the source exactly
    for p in pairs:
        n = p.bytes
        ctypes_copy(p.local_addr, p.remote_addr, n)
    for (name, a), (_, b) in zip(processed_tensors(src), processed_tensors(dst)):
        assert torch.equal(a, b), name
    assert dst.head.weight is dst.embed.weight


def ctypes_copy(dst: int, src: int, n: int) -> None:
    import ctypes

    ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("change, message", [
    (lambda m: setattr(m.layer, "extra", torch.zeros(3)), "lacks"),
    (lambda m: delattr(m.layer, "q_view"), "does not serve"),
    (lambda m: setattr(m.layer, "qk", m.layer.qk.to(torch.float16)), "F16"),
    (lambda m: setattr(m.layer, "qk", m.layer.qk.t()), "[16, 8]"),
    (lambda m: setattr(m.head, "weight", nn.Parameter(m.embed.weight.detach().clone())), "tied"),
])
def test_a_different_layout_is_refused_before_any_byte_moves(change, message: str) -> None:
    src, dst = _model(0), _model(1)
    change(src)
    before = [t.clone() for _, t in processed_tensors(dst)]
    with pytest.raises(LayoutMismatch) as info:
        match(processed_tensors(dst), describe(group_tensors(processed_tensors(src))))
    assert message in str(info.value) and info.value.landed is False
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, processed_tensors(dst)))


def test_a_stride_difference_is_refused() -> None:
    src, dst = _model(0), _model(1)
    src.layer.qk = torch.empty(8, 16).t()  # same shape [16, 8], other strides
    with pytest.raises(LayoutMismatch, match="stride"):
        match(processed_tensors(dst), describe(group_tensors(processed_tensors(src))))


def test_keep_raw_copies_every_group_into_one_buffer_with_the_original_layout() -> None:
    src = _model(0, post=False)
    named = [(n, t) for n, t in processed_tensors(src)]
    copy = keep_raw(named)
    assert copy.bytes >= sum(span_bytes(g.tensor) for g in group_tensors(named))
    base, end = copy.buffer.data_ptr(), copy.buffer.data_ptr() + copy.bytes
    assert all(base <= e["addr"] < end and e["device"] == "cpu" for e in copy.entries)
    with torch.no_grad():  # the copy is a snapshot: later changes of the model do not reach it
        src.embed.weight.add_(1)
    dst = _model(1, post=False)
    for p in match(processed_tensors(dst), copy.entries):
        ctypes_copy(p.local_addr, p.remote_addr, p.bytes)
    fresh = _model(0, post=False)
    for (name, a), (_, b) in zip(processed_tensors(fresh), processed_tensors(dst)):
        assert torch.equal(a, b), name


def test_byte_view_of_a_strided_tensor_spans_its_extent() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[:, 1:3]
    assert span_bytes(view) == ((3 * 6 + 1 * 1) + 1) * 4
    assert byte_view(view).numel() == span_bytes(view)
    assert byte_view(view)[:4].view(torch.float32).item() == 1.0


def test_regions_one_per_storage_on_the_cpu_and_the_index_finds_them() -> None:
    m = _model(0)
    tensors = [t for _, t in processed_tensors(m)]
    regions = regions_for(tensors)
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    assert len(regions) == len(storages)
    find = region_index(regions)
    assert find(m.layer.q_view) == find(m.layer.qk) >= 0


def test_empty_placeholders_a_source_does_not_serve_are_not_missing() -> None:
    """vLLM 0.26 on a GPU: every attention layer holds `kv_cache = torch.tensor([])` as a plain attribute
    until the KV cache exists; sources serve only groups with bytes, so the target must not ask for them."""
    src, dst = _model(0), _model(1)
    for m in (src, dst):
        m.layer.kv_cache = torch.tensor([])
    served = [g for g in group_tensors(processed_tensors(src)) if g.tensor.numel()]  # as plugin/p2p_source.serve does
    assert "layer.kv_cache" not in {n for g in served for n in g.names}
    pairs = match(processed_tensors(dst), describe(served))
    assert pairs and all(p.bytes for p in pairs)
