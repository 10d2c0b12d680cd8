"""A lean snapshot's refill (plugin/weight_refill.py): a model whose weights were discarded gets back exactly
what the capture holds, from the plan's files, and a layout that does not fit is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxlaunch.fileutil import write_json_atomic
from mxlaunch.plan import Plan, RankFile
from mxlaunch.plugin.capture import capture_tensors
from mxlaunch.plugin.loader import module_tensors
from mxlaunch.plugin.weight_refill import (METHOD, RefillError, WeightRefill, fingerprint, refill, take_fingerprint,
                                           tensor_print)

pytestmark = pytest.mark.unit


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("scale", torch.arange(width, dtype=torch.float32))  # persistent: in the capture


def _captured(tmp_path: Path, model: torch.nn.Module, name: str = "store") -> Path:
    """Capture `model` into the store-like folder and write a plan pointing rank 0 at the files; the plan."""
    out = tmp_path / name / "0"
    capture_tensors(module_tensors(model), out, fsync=False)
    run = tmp_path / f"run-{name}"
    run.mkdir(mode=0o700)
    files = [RankFile(path=str(p), bytes=p.stat().st_size) for p in sorted(out.glob("*.safetensors"))]
    plan = Plan(strategy="staged", source_id="sid", run_dir=str(run), ranks={"0": files}, wait_timeout_s=5)
    write_json_atomic(run / "plan.json", plan.to_dict(), private=True)
    return run / "plan.json"


def test_a_discarded_model_is_refilled_exactly_and_the_launcher_hears_it_loaded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    served = Tiny()
    plan = _captured(tmp_path, served)
    want = {n: t.clone() for n, t in module_tensors(served)}
    with torch.no_grad():  # what level-2 sleep leaves behind: the memory is back, its contents garbage
        for _, t in module_tensors(served):
            t.fill_(float("nan"))
    done = refill(served, str(plan), rank=0)
    assert all(torch.equal(t, want[n]) for n, t in module_tensors(served))
    assert done["bytes"] == sum(t.numel() * t.element_size() for t in want.values()) and done["rank"] == 0
    marker = json.loads((tmp_path / "run-store" / "markers" / "loaded-0.json").read_text())
    assert marker["strategy"] == "refill" and marker["bytes"] == done["bytes"]


def test_a_model_whose_layout_differs_from_the_files_is_refused(tmp_path: Path) -> None:
    plan = _captured(tmp_path, Tiny(8))
    with pytest.raises(RefillError, match="refilling the weights failed"):
        refill(Tiny(4), str(plan), rank=0)
    with pytest.raises(RefillError, match="lists no files for rank 3"):
        refill(Tiny(8), str(plan), rank=3)


def test_a_refill_stops_waiting_once_the_launcher_aborts_the_stage(tmp_path: Path) -> None:
    """A stage that failed writes markers/abort.json: the refill gives up then, not after wait_timeout_s."""
    import time

    from mxlaunch.contract import ABORT

    plan_path = _captured(tmp_path, Tiny())
    missing = tmp_path / "run-store" / "stage" / "0" / "never.safetensors"
    plan = Plan(strategy="staged", source_id="sid", run_dir=str(plan_path.parent),
                ranks={"0": [RankFile(path=str(missing), bytes=64)]}, wait_timeout_s=120)
    write_json_atomic(plan_path, plan.to_dict(), private=True)
    markers = tmp_path / "run-store" / "markers"
    markers.mkdir(parents=True, exist_ok=True)
    write_json_atomic(markers / ABORT, {"reason": "the stage failed"}, private=True)
    began = time.monotonic()
    with pytest.raises(RefillError, match="refilling the weights failed"):
        refill(Tiny(), str(plan_path), rank=0)
    assert time.monotonic() - began < 60  # the 120 s wait was cut short by the abort marker


def test_vllm_calls_the_extension_by_its_method_name_on_the_worker(tmp_path: Path) -> None:
    """vLLM mixes the class into its worker and runs `getattr(worker, METHOD)(plan)` (a name: nothing pickled)."""
    torch.manual_seed(1)
    model = Tiny()
    plan = _captured(tmp_path, model)
    want = model.proj.weight.clone()
    with torch.no_grad():
        model.proj.weight.zero_()

    class Worker(WeightRefill):
        model_runner = type("Runner", (), {"model": model})()
        vllm_config = None

    assert getattr(Worker(), METHOD)(str(plan))["rank"] == 0
    assert torch.equal(model.proj.weight, want)


def test_a_refill_must_give_back_the_weights_the_engine_served_before_its_sleep(tmp_path: Path) -> None:
    """The fingerprint taken before the sleep: files that fit the layout but hold other values are refused."""
    torch.manual_seed(2)
    served, other = Tiny(), Tiny()  # the same layout, other values (a capture the engine did not serve)
    plan, wrong = _captured(tmp_path, served), _captured(tmp_path, other, "other")
    assert take_fingerprint(served, str(plan), 0) == {"rank": 0, "why": "", "tensors": 3}
    with pytest.raises(RefillError, match=r"differ from the engine's own at the snapshot, e\.g\. proj\."):
        refill(served, str(wrong), rank=0)
    assert refill(served, str(plan), rank=0)["bytes"] > 0  # its own snapshot: the same fingerprint


def test_files_of_another_layout_refuse_the_lean_sleep_before_anything_changes(tmp_path: Path) -> None:
    plan = _captured(tmp_path, Tiny(8))
    live = Tiny(4)
    before = fingerprint(live)
    got = take_fingerprint(live, str(plan), 0)
    assert "the snapshot's layout is not the live one" in got["why"] and got["tensors"] == 0
    assert fingerprint(live) == before  # headers only: nothing was written


def test_the_fingerprint_sees_a_moved_byte_and_spans_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import mxlaunch.plugin.weight_refill as wr

    t = torch.arange(1000, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 700]] = swapped[[700, 3]]  # the same values, two moved
    assert tensor_print(t) != tensor_print(swapped) and tensor_print(t) == tensor_print(t.clone())
    whole = tensor_print(t)
    monkeypatch.setattr(wr, "CHUNK", 64)  # many chunks: the positions continue across them
    assert tensor_print(t) == whole
