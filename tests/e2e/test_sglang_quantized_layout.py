"""SGLang's own quantized layers through mxlaunch's SGLang loader: capture, then a staged restore (issue 40).

SGLang 0.5.23 serves no quantized model on this CPU (its kernels need AMX or CUDA; docs/quantized.md), so the
live launch tests cannot cover its quantized paths. What can run here is everything up to the kernels: SGLang
builds each model (its config parser, its quant method's create_weights) and loads the checkpoint through the
model's own load_weights. tests/helpers/sglang_quant_oracle.py does that three times per method inside SGLang's
venv — SGLang's DefaultModelLoader (the oracle), mxlaunch's loader capturing, mxlaunch's loader restoring from
the capture's files without reading the checkpoint — and compares every parameter and buffer right before
SGLang's post-processing, then after it where this CPU can run it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.quantized_model import KV_SCALES, cached_quantized, quantize_model, wide_llama
from tests.helpers.sglang_server import REPO, SGLANG_ENV, sglang_python
from tests.helpers.tiny_model import cached_model

pytestmark = pytest.mark.live_setup  # SGLang's venv / the CRIU kit (tests/helpers/live_setup.py)

NVFP4_RAW = {"weight_packed": "torch.uint8", "weight_scale": "torch.float8_e4m3fn", "weight_global_scale": "torch.float32",
             "input_global_scale": "torch.float32"}
# method → (SGLang's quant method class, the qkv projection's raw tensors: name suffix → dtype)
EXPECTED = {
    # online: SGLang keeps the checkpoint's bf16 weight until post-processing (why SGLang needs no refusal)
    "fp8-online": ("Fp8LinearMethod", {"weight": "torch.bfloat16"}),
    "awq": ("AWQLinearMethod", {"qweight": "torch.int32", "qzeros": "torch.int32", "scales": "torch.float16"}),
    "gptq": ("GPTQLinearMethod", {"qweight": "torch.int32", "qzeros": "torch.int32", "scales": "torch.float16",
                                  "g_idx": "torch.int32"}),
    "w8a8-int8": ("CompressedTensorsLinearMethod", {"weight": "torch.int8", "weight_scale": "torch.float32"}),
    "w8a8-fp8": ("CompressedTensorsLinearMethod", {"weight": "torch.float8_e4m3fn", "weight_scale": "torch.float32"}),
    "block-fp8": ("Fp8LinearMethod", {"weight": "torch.float8_e4m3fn", "weight_scale_inv": "torch.float32"}),
    # W8A8 INT8 with an fp8 KV cache: the checkpoint's per-tensor k/v scales land in the attention layer (below)
    "w8a8-int8-kvfp8": ("CompressedTensorsLinearMethod", {"weight": "torch.int8", "weight_scale": "torch.float32"}),
    # NVFP4 (W4A4): SGLang asks for compute capability 10.0 (Blackwell); on 9.0 (Hopper) it serves the same checkpoint
    # weight-only through FP4 Marlin (CompressedTensorsW4A16Fp4): the raw tensors are the checkpoint's in both
    "nvfp4": ("CompressedTensorsLinearMethod", NVFP4_RAW),
    "nvfp4-hopper": ("CompressedTensorsLinearMethod", NVFP4_RAW),
    # ModelOpt's NVFP4: one method on every GPU (its post-processing asks for SM100, or --fp4-gemm-backend marlin)
    "modelopt-nvfp4": ("ModelOptFp4LinearMethod", {"weight": "torch.uint8", "weight_scale": "torch.float8_e4m3fn",
                                                   "weight_scale_2": "torch.float32", "input_scale": "torch.float32"}),
    # ModelOpt's FP8 (nvidia/*-FP8 on the Hub): per-tensor weight scale and a static input scale
    "modelopt-fp8": ("ModelOptFp8LinearMethod", {"weight": "torch.float8_e4m3fn", "weight_scale": "torch.float32",
                                                 "input_scale": "torch.float32"}),
    # a compressed-tensors FP8 Mixtral: the attention as above, the experts stacked by SGLang's FusedMoE (below)
    "moe-w8a8-fp8": ("CompressedTensorsLinearMethod", {"weight": "torch.float8_e4m3fn", "weight_scale": "torch.float32"}),
}
# the MoE cases: the experts' quant method and their raw tensors (SGLang 0.5.23's compressed-tensors W8A8 INT8 MoE is
# NPU-only — "The W8A8Int8 Fused MoE scheme is implemented only for NPU for now" — so no INT8 MoE case)
MOE = {"moe-w8a8-fp8": ("CompressedTensorsFusedMoEMethod",
                        {"w13_weight": "torch.float8_e4m3fn", "w2_weight": "torch.float8_e4m3fn",
                         "w13_weight_scale": "torch.float32", "w2_weight_scale": "torch.float32"})}
# SGLang's get_model_loader picks ModelOptModelLoader for ModelOpt checkpoints; on a pre-quantized one it loads as
# DefaultModelLoader does, and the hook must still hand back mxlaunch's loader (else every rank falls back)
FACTORY = {"modelopt-nvfp4": "ModelOptModelLoader", "modelopt-fp8": "ModelOptModelLoader"}
SCHEMES = {"nvfp4": "CompressedTensorsW4A4Fp4", "nvfp4-hopper": "CompressedTensorsW4A16Fp4"}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    python = sglang_python()
    if not python.exists():
        pytest.fail(f"needs SGLang's venv at {python} — run `make sglang-venv`")
    cache = tmp_path_factory.mktemp("models")
    tiny = cached_model(cache)
    block = quantize_model(wide_llama(tiny, cache / "wide"), cache / "wide-block-fp8", "block-fp8")
    cases = [{"name": "fp8-online", "model": str(tiny), "dtype": "bfloat16", "quantization": "fp8"},
             {"name": "awq", "model": str(cached_quantized(cache, "awq")), "dtype": "float16"},
             {"name": "gptq", "model": str(cached_quantized(cache, "gptq")), "dtype": "float16"},
             {"name": "block-fp8", "model": str(block), "dtype": "bfloat16"}]
    cases += [{"name": m, "model": str(cached_quantized(cache, m)), "dtype": "bfloat16", "cuda_capability": [9, 0]}
              for m in ("w8a8-int8", "w8a8-fp8")]
    nvfp4 = str(cached_quantized(cache, "nvfp4"))
    cases += [{"name": "nvfp4", "model": nvfp4, "dtype": "bfloat16", "cuda_capability": [10, 0]},
              {"name": "nvfp4-hopper", "model": nvfp4, "dtype": "bfloat16", "cuda_capability": [9, 0]},
              {"name": "modelopt-nvfp4", "model": str(cached_quantized(cache, "modelopt-nvfp4")), "dtype": "bfloat16",
               "cuda_capability": [10, 0]},
              {"name": "modelopt-fp8", "model": str(cached_quantized(cache, "modelopt-fp8")), "dtype": "bfloat16",
               "cuda_capability": [9, 0]}]
    cases.append({"name": "moe-w8a8-fp8", "model": str(cached_quantized(cache, "w8a8-fp8", moe=True)),
                  "dtype": "bfloat16", "cuda_capability": [9, 0]})
    cases.append({"name": "w8a8-int8-kvfp8", "model": str(cached_quantized(cache, "w8a8-int8-kvfp8")),
                  "dtype": "bfloat16", "cuda_capability": [9, 0], "kv_cache_dtype": "fp8_e4m3"})
    work = tmp_path_factory.mktemp("oracle")
    (work / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([str(python), str(REPO / "tests" / "helpers" / "sglang_quant_oracle.py"),
                           str(work / "cases.json"), str(work / "out.json")],
                          env={**os.environ, **SGLANG_ENV}, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["name"]: r for r in json.loads((work / "out.json").read_text())}


@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_staged_restore_holds_what_sglangs_loader_left(oracle: dict[str, dict], method: str) -> None:
    result = oracle[method]
    assert "error" not in result, result.get("traceback", result)
    quant_class, qkv = EXPECTED[method]
    assert result["quant_method"] == quant_class  # SGLang built this method's layers, not a float model
    assert result["factory"] == FACTORY.get(method, "DefaultModelLoader"), result["factory"]
    assert result["hooked"] == "MxlaunchSGLangLoader", result["hooked"]  # a launch captures and restores it
    if method in SCHEMES:  # compressed-tensors NVFP4: the scheme SGLang chose for the capability
        assert result["scheme"] == SCHEMES[method]
    got = {name.rsplit(".", 1)[1]: dtype for name, (dtype, _) in result["qkv_raw"].items()}
    assert got == qkv, got
    if method in MOE:  # SGLang's FusedMoE holds every expert's checkpoint tensors stacked, as the loader left them
        moe_class, experts = MOE[method]
        assert result["moe_method"] == moe_class, result["moe_method"]
        assert {name: dtype for name, (dtype, _) in result["experts_raw"].items()} == experts, result["experts_raw"]
    if method.endswith("-kvfp8"):  # the checkpoint's scales, not the layer's default 1.0, are what is restored
        scales = {name.rsplit(".", 1)[1]: value for name, (_, _, value) in result["attn_raw"].items()}
        assert scales == {f"{kv}_scale": KV_SCALES[kv] for kv in "kv"}, scales
    assert result["capture_files"] >= 1
    assert result["staged_strategy"] == "staged" and result["staged_bytes"] > 0, result
    # every parameter and buffer, by name, dtype, shape and bytes, as SGLang's own loader left them
    assert result["raw_vs_engine"] == {"capture": [], "staged": []}, result["raw_vs_engine"]
    errors = result["post_errors"]
    if errors:  # this CPU cannot post-process the method (AMX kernels): the same for SGLang alone
        assert set(errors) == {"engine", "capture", "staged"} and len(set(errors.values())) == 1, errors
    else:
        assert result["post_vs_engine"] == {"capture": [], "staged": []}, result["post_vs_engine"]
