"""The GPU harness's quantized batches (scripts/bench/gpu_engine_e2e.py, issue 40) on the CPU: which model a
`--quant`/`--moe` batch serves and the method its records carry, and what one record of `--quant-out` says
(the capture against the engine alone with warm caches; the p2p puller's source)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import quantized_model
from tests.helpers.tiny_model import cached_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def harness() -> object:
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    spec = importlib.util.spec_from_file_location("gpu_engine_e2e", REPO / "scripts" / "bench" / "gpu_engine_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_batch_serves_a_quantized_mixtral_named_moe(harness: object, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized_model, "GPU_MOE", {"experts": 8, "top_k": 2, "hidden": 128, "intermediate": 128,
                                                     "layers": 1})  # the GPU's Mixtral, small
    base = cached_model(tmp_path / "cache")
    model, method = harness.quant_model(base, tmp_path / "models", "tiny", "w8a8-fp8", moe=True)
    config = json.loads((model / "config.json").read_text())
    assert method == "w8a8-fp8-moe" and config["model_type"] == "mixtral" and config["num_local_experts"] == 8
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert harness.quant_model(base, tmp_path / "models", "tiny", "fp8-online", moe=False) == (base, "fp8-online")
    model, method = harness.quant_model(base, tmp_path / "models", "tiny", "block-fp8", moe=False)
    assert method == "block-fp8" and model.parent == tmp_path / "models"
    assert json.loads((model / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_quant_record_compares_with_the_engine_alone_and_names_the_source(harness: object, tmp_path: Path) -> None:
    log = tmp_path / "p2p.log"
    log.write_text("INFO Selected DeepGemmFp8BlockScaledMMKernel for Fp8LinearMethod\n"
                   "INFO Using TRITON Fp8 MoE backend out of potential backends: ['TRITON']\n")
    runs = [{"name": "default", "verify": "gold", "ready_s": 200.0},   # the gold's start: JIT caches cold
            {"name": "default", "verify": "exact", "ready_s": 50.0},   # the engine alone, caches warm
            {"name": "capture", "strategy": "capture", "verify": "exact", "ready_s": 52.0},
            {"name": "p2p", "strategy": "p2p", "verify": "exact", "ready_s": 40.0, "source_strategy": "staged",
             "source_fallback": None, "loaded_event": {"transport": "CUDA IPC"}, "log": str(log)}]
    out, doc = tmp_path / "q.json", {"gpu": "H200", "model": {"name": "llama-8GiB-block-fp8"}}
    for i, rec in enumerate(runs):
        harness.add_quant_record(out, rec, "block-fp8", "0.26.0", doc, runs[: i + 1])
    records = json.loads(out.read_text())["records"]
    assert [r["engine_alone_ready_s"] for r in records] == [None, None, 50.0, 50.0]
    assert records[2]["ready_vs_engine_alone"] == 1.04 and records[2]["model"] == "llama-8GiB-block-fp8"
    p2p = records[3]
    assert (p2p["source_strategy"], p2p["transport"], p2p["verify"]) == ("staged", "CUDA IPC", "exact")
    assert p2p["kernels"] == ["DeepGemmFp8BlockScaledMMKernel Fp8LinearMethod", "TRITON"]
    assert "transport" not in records[2]


def test_a_batch_refuses_a_gpu_an_earlier_run_left_held_and_a_cut_batch_stops_its_start(
        harness: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 31: a run cut by `timeout` left its engine (a session of its own) holding 57 GB, and the next batch's
    starts all failed on it. The harness now names the holder before it starts anything, and turns SIGTERM into
    `Cut`, which its starts' `finally` blocks get (so they stop their engines) and `run` records."""
    import signal

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\necho "4242, 57344"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{__import__('os').environ['PATH']}")
    assert harness.gpu_holders() == ["4242 (57344 MiB)"]
    smi.write_text("#!/bin/sh\n")  # nothing holds it
    assert harness.gpu_holders() == []

    stopped: list[str] = []

    def cut_start(scenario: str) -> dict:
        try:
            harness._cut(signal.SIGTERM, None)
        finally:
            stopped.append(scenario)  # what Start.stop does in _one's `finally`
        return {}

    old = signal.getsignal(signal.SIGTERM)
    try:
        h = harness.Harness(tmp_path / "work", tmp_path / "model", 0.5, 1.0)
        monkeypatch.setattr(h, "_one", cut_start)
        monkeypatch.setattr(harness, "evict", lambda *a: 0)
        rec = h.run("default")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert stopped == ["default"] and rec["cut"] is True and "cut by signal" in rec["error"], rec
    assert json.loads(h.record_path.read_text())[-1]["cut"] is True  # written before the batch ends
