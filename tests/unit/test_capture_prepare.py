"""The capture prepared during loading (plugin/capture_prepare.py): parts laid out in tmpfs while the
engine loads, then filled by copies. On this CPU box the copies are memcpys (on a GPU they are DMAs into
page-locked pages; docs/benchmarks.md has that run). The oracle is the writers' path: both must produce
byte-identical files, and the files must restore exactly."""

from __future__ import annotations

import filecmp
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

from mxlaunch.plan import Plan
from mxlaunch.plugin.capture import capture_tensors
from mxlaunch.plugin.capture_prepare import PreparedCapture
from mxlaunch.plugin.cuda_copier import is_tmpfs
from mxlaunch.plugin.loader import CaptureError, module_tensors, restore_tensors
from mxlaunch.plugin.rank_load import RankLoad

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not is_tmpfs(SHM), reason="needs /dev/shm on tmpfs")
META = {"mxlaunch.rank": "0", "mxlaunch.source_id": "f" * 16}


@pytest.fixture
def shm() -> Iterator[Path]:
    folder = SHM / f"mxlaunch-test-{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tensors() -> list[tuple[str, torch.Tensor]]:
    """Several parts (small part size), a tie, mixed dtypes, a zero-size and a non-contiguous tensor, and a
    one-element per-tensor scale expanded from a scalar (stride 0, which torch 2.13 still calls contiguous)."""
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(700, 48, generator=g)
    return [("embed.weight", emb), ("lm_head.weight", emb),
            ("layer.w", torch.randn(96, 133, generator=g).to(torch.bfloat16)),
            ("layer.idx", torch.arange(37, dtype=torch.int64)),
            ("layer.empty", torch.empty(0, 5)),
            ("layer.t", torch.randn(40, 24, generator=g).t()),
            ("norm.weight", torch.ones(48, dtype=torch.float16)),
            ("layer.weight_scale", torch.tensor(0.25).expand(1))]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*.tmp"))


def test_prepared_parts_equal_the_written_parts_byte_for_byte(shm: Path) -> None:
    named = tensors()
    written = capture_tensors(named, shm / "written", metadata=META, part_bytes=20_000)
    prep = PreparedCapture.start(named, shm / "prepared", metadata=META, part_bytes=20_000)
    assert prep is not None
    got = capture_tensors(named, shm / "prepared", metadata=META, part_bytes=20_000, prepared=prep)
    assert got.prepared is not None and written.prepared is None
    assert [p.name for p in got.files] == [p.name for p in written.files] and len(got.files) >= 3
    for a, b in zip(written.files, got.files):
        assert filecmp.cmp(a, b, shallow=False), a.name
    assert (got.bytes, got.tensors) == (written.bytes, written.tensors)
    assert leftovers(shm) == []
    targets = [(n, torch.zeros_like(t)) for n, t in named]
    targets[1] = ("lm_head.weight", targets[0][1])  # tied in the target as in the source
    restore_tensors(targets, [str(p) for p in got.files], wait_timeout_s=1)
    for (name, want), (_, have) in zip(named, targets):
        assert torch.equal(want, have), name


def test_a_tensor_replaced_during_loading_is_written_the_old_way(shm: Path) -> None:
    named = tensors()
    prep = PreparedCapture.start(named, shm / "out", metadata=META, part_bytes=20_000)
    assert prep is not None
    changed = [(n, torch.randn(5, 5) if n == "layer.w" else t) for n, t in named]  # a loader swapped a parameter
    got = capture_tensors(changed, shm / "out", metadata=META, part_bytes=20_000, prepared=prep)
    assert got.prepared is None
    assert leftovers(shm) == []
    again = capture_tensors(changed, shm / "again", metadata=META, part_bytes=20_000)
    for a, b in zip(again.files, got.files):
        assert filecmp.cmp(a, b, shallow=False), a.name


def test_a_failed_write_leaves_no_part_and_no_temp_file(shm: Path) -> None:
    named = tensors()
    out = shm / "out"
    prep = PreparedCapture.start(named, out, metadata=META, part_bytes=20_000)
    assert prep is not None
    (out / "part-00002.safetensors").mkdir(parents=True)  # the rename of the third part cannot succeed
    with pytest.raises(CaptureError, match="cannot write the snapshot"):
        capture_tensors(named, out, metadata=META, part_bytes=20_000, prepared=prep)
    assert sorted(p.name for p in out.iterdir()) == ["part-00002.safetensors"]  # only what was there before
    assert leftovers(shm) == []


def test_not_prepared_off_tmpfs_or_when_turned_off(tmp_path: Path, shm: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if not is_tmpfs(tmp_path):
        assert PreparedCapture.start(tensors(), tmp_path / "out") is None
    monkeypatch.setenv("MXLAUNCH_CAPTURE_PREPARE", "0")
    assert PreparedCapture.start(tensors(), shm / "out") is None


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4, bias=False)


def load(model: Tiny) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / (i + 3))


def test_rank_load_captures_into_parts_prepared_while_the_engine_loaded(shm: Path, tmp_path: Path) -> None:
    """RankLoad (what both adapters call): the prepared path runs, the marker says so, the files restore."""
    run = tmp_path / "run"
    run.mkdir()
    plan = Plan(strategy="capture", source_id="f" * 16, run_dir=str(run), capture_dir=str(shm / "capture"),
                ranks={}, wait_timeout_s=5)
    model = Tiny()
    outcome = RankLoad(model, plan, 0, lambda: load(model), engine="T", log=logging.getLogger("test")).run()
    assert outcome.strategy == "capture"
    marker = json.loads((run / "markers" / "captured-0.json").read_text())
    assert marker["prepared"]["huge_bytes"] >= 0
    files = sorted((shm / "capture" / "0").glob("*.safetensors"))
    fresh = Tiny()
    restore_tensors(module_tensors(fresh), [str(f) for f in files], wait_timeout_s=1)
    for (name, want), (_, have) in zip(module_tensors(model), module_tensors(fresh)):
        assert torch.equal(want, have), name
    assert leftovers(shm) == []
