"""Why mxlaunch snapshots raw tensors: with a model whose post-processing changes its weights (as
SGLang's AMX packing and quantization repacking do on real hardware), the raw snapshot restores to
exactly what the default loader serves, and a snapshot taken after post-processing (what SGLang's stock
sharded_state/presharded dumps hold) does not. This CPU box has no AMX, so SGLang's own CPU
post-processing is a no-op here — the live SGLang tests cannot tell the two apart; this test can.
Runs RankLoad, the code both engine adapters call, with real files and markers."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from mxlaunch.plan import Plan, RankFile
from mxlaunch.plugin.loader import capture_tensors, module_tensors
from mxlaunch.plugin.rank_load import RankLoad

log = logging.getLogger("test")
CHECKPOINT = {"proj.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7,
              "proj.bias": torch.linspace(-1, 1, 6)}


class Packed(nn.Module):
    """A layer whose post-processing repacks its weight in place (scale + transpose-and-back shuffle)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()


def load_checkpoint(model: Packed) -> None:
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.copy_(CHECKPOINT[name])


def post_process(model: Packed) -> None:
    with torch.no_grad():
        w = model.proj.weight
        w.copy_((w * 3 + 0.5).flip(0))  # not idempotent: applying it twice gives other numbers


def served(model: Packed) -> torch.Tensor:
    return model.proj(torch.ones(1, 4))


def plan_for(tmp: Path, strategy: str, files: list[Path] = ()) -> Plan:
    run = tmp / f"run-{strategy}"
    run.mkdir(exist_ok=True)
    return Plan(strategy=strategy, source_id="0" * 16, run_dir=str(run), capture_dir=str(tmp / "capture"),
                ranks={"0": [RankFile(path=str(f), bytes=f.stat().st_size) for f in files]}, wait_timeout_s=5)


def test_raw_snapshot_restores_exactly_what_the_default_loader_serves(tmp_path: Path) -> None:
    default = Packed()
    load_checkpoint(default)
    post_process(default)
    gold = served(default)

    # first serve: capture raw (after weight loading, before post-processing)
    first = Packed()
    capture = RankLoad(first, plan_for(tmp_path, "capture"), 0, lambda: load_checkpoint(first), engine="T", log=log)
    outcome = capture.run()
    post_process(first)
    assert outcome.strategy == "capture" and torch.equal(served(first), gold)
    raw_files = sorted((tmp_path / "capture" / "0").glob("*.safetensors"))
    assert raw_files and (tmp_path / "run-capture" / "markers" / "captured-0.json").exists()

    # next serve: staged restore from the raw snapshot, then the engine's post-processing as usual
    second = Packed()
    restore = RankLoad(second, plan_for(tmp_path, "staged", raw_files), 0,
                       lambda: (_ for _ in ()).throw(AssertionError("the checkpoint must not be read")),
                       engine="T", log=log)
    assert restore.run().strategy == "staged"
    post_process(second)
    assert torch.equal(served(second), gold)

    # a snapshot of the post-processed weights, restored the same way, serves other numbers
    dumped = tmp_path / "postprocessed"
    capture_tensors(module_tensors(first), dumped, metadata={})
    third = Packed()
    RankLoad(third, plan_for(tmp_path, "staged", sorted(dumped.glob("*.safetensors"))), 0, lambda: None,
             engine="T", log=log).run()
    post_process(third)
    assert not torch.allclose(served(third), gold)
