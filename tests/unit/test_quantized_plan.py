"""Quantized vLLM commands in the plan and the source id (issue 40): a method a snapshot cannot restore is
planned `default` with its reason before the engine starts; quantization settings never share a snapshot."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from mxlaunch.engines.registry import spec_engine
from mxlaunch.engines.sglang_argv import parse_sglang_argv
from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.identity import source_id
from mxlaunch.launch.decide import LaunchOptions, make_plan

PY = sys.executable


def checkpoint(folder: Path, **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, **config}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    return folder


def plan(model: Path, store: Path, *extra: str) -> dict:
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *extra]
    return make_plan(argv, LaunchOptions(artifact_path=store)).to_json()


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("config,extra", [
    ({}, ()),                                            # bf16
    ({}, ("--quantization", "fp8")),                     # online fp8: restored through its processed layout
    ({}, ("-q", "fp8_per_block")),
    ({"quantization_config": AWQ}, ()),                  # pre-quantized: the raw snapshot
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, ("-q", "compressed-tensors")),
    ({"quantization_config": {"quant_method": "fp8"}}, ("-q", "fp8")),  # a stored fp8 checkpoint, not online
])
def test_restorable_methods_capture(tmp_path: Path, config: dict, extra: tuple) -> None:
    p = plan(checkpoint(tmp_path / "m", **config), tmp_path / "store", *extra)
    assert p["strategy"] == "capture", p["reason"]


@pytest.mark.parametrize("config,extra,says", [
    ({}, ("--quantization", "bitsandbytes"), "own bitsandbytes loader"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, (), "own bitsandbytes loader"),
    ({}, ("-q", "torchao"), "torchao"),
    ({}, ("-q", "int8_per_channel_weight_only"), "online quantization other than fp8"),
    ({}, ("-q", "mxfp8"), "online quantization other than fp8"),
    ({"num_local_experts": 8}, ("-q", "fp8"), "mixture-of-experts"),
    ({"text_config": {"n_routed_experts": 64}}, ("-q", "fp8_per_block"), "mixture-of-experts"),
])
def test_unrestorable_methods_are_planned_default_with_the_reason(tmp_path: Path, config: dict, extra: tuple,
                                                                  says: str) -> None:
    p = plan(checkpoint(tmp_path / "m", **config), tmp_path / "store", *extra)
    assert p["strategy"] == "default" and says in p["reason"], p["reason"]


def test_quantization_settings_keep_snapshots_apart(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")

    def sid(*extra: str) -> str:
        return source_id(parse_vllm_argv(["vllm", "serve", str(model), *extra], engine_version="0.32.0"),
                         device_type="cuda")

    ids = {sid(), sid("-q", "fp8"), sid("-q", "fp8_per_block"), sid("-q", "fp8_per_channel"),
           sid("-q", "fp8", "--dtype", "float16")}
    assert len(ids) == 5
    before = sid()
    checkpoint(model, quantization_config=AWQ)  # the same weights, quantization settings in config.json
    awq32 = sid()
    checkpoint(model, quantization_config={**AWQ, "group_size": 128})
    g128 = sid()
    assert len({before, awq32, g128}) == 3
    (model / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64}))  # AutoGPTQ's own file
    assert sid() != g128



def sglang_refusal(model: Path, *extra: str) -> str | None:
    """What the plan says for this SGLang command (make_plan asks the engine's quantization_refusal)."""
    spec = parse_sglang_argv(["python", "-m", "sglang.launch_server", "--model-path", str(model), *extra],
                             engine_version="0.5.23")
    return spec_engine(spec).quantization_refusal(spec)


MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8"}


@pytest.mark.parametrize("config,extra,files", [
    ({}, (), {}),
    ({}, ("--quantization", "fp8"), {}),                                  # online fp8: bf16 until post-processing
    ({"quantization_config": AWQ}, (), {}),
    ({"quantization_config": MODELOPT_FP8}, ("--quantization", "modelopt_fp8"), {}),  # pre-quantized ModelOpt
    ({}, ("--quantization", "modelopt_fp4"), {"hf_quant_config.json": "{}"}),  # ModelOpt's own config file
])
def test_sglang_restorable_methods_are_not_refused(tmp_path: Path, config: dict, extra: tuple, files: dict) -> None:
    model = checkpoint(tmp_path / "m", **config)
    for name, text in files.items():
        (model / name).write_text(text)
    assert sglang_refusal(model, *extra) is None


@pytest.mark.parametrize("config,extra,says", [
    ({}, ("--quantization", "modelopt_fp8"), "ModelOpt quantizes it while loading"),
    ({}, ("--quantization", "modelopt_fp4"), "ModelOpt quantizes it while loading"),
    ({}, ("--quantization", "auto-round-int8"), "IncModelLoader"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, (), "own bitsandbytes loader"),
])
def test_sglang_unrestorable_methods_are_refused_with_the_reason(tmp_path: Path, config: dict, extra: tuple,
                                                                 says: str) -> None:
    why = sglang_refusal(checkpoint(tmp_path / "m", **config), *extra)
    assert why is not None and says in why, why


@pytest.mark.parametrize("config,extra,want", [
    ({}, (), None),                                                           # bf16: no entry
    ({}, ("--quantization", "fp8"), ("fp8", "--quantization", "processed")),  # vLLM's online fp8
    ({"quantization_config": AWQ}, (), ("awq", "checkpoint", "raw")),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}, (), ("modelopt/FP8", "checkpoint", "raw")),
    ({}, ("-q", "bitsandbytes"), ("bitsandbytes", "--quantization", "default")),
])
def test_the_plan_says_how_a_quantized_vllm_model_is_restored(tmp_path: Path, config: dict, extra: tuple,
                                                               want: tuple | None) -> None:
    q = plan(checkpoint(tmp_path / "m", **config), tmp_path / "store", *extra)["quantization"]
    assert (q if q is None else (q["method"], q["named_by"], q["restore"])) == want, q
    if q is not None and q["restore"] == "default":
        assert "bitsandbytes loader" in q["reason"]  # the refusal's own words


@pytest.mark.parametrize("config,extra,files,want", [
    ({}, ("--quantization", "fp8"), {}, ("fp8", "raw")),                      # SGLang keeps bf16 until post-processing
    ({}, ("--quantization", "modelopt_fp8"), {}, ("modelopt_fp8", "default")),
    ({}, (), {"hf_quant_config.json": "{}"}, ("modelopt", "raw")),           # ModelOpt's older export
])
def test_the_plan_says_how_a_quantized_sglang_model_is_restored(tmp_path: Path, config: dict, extra: tuple, files: dict,
                                                                 want: tuple) -> None:
    model = checkpoint(tmp_path / "m", **config)
    for name, text in files.items():
        (model / name).write_text(text)
    spec = parse_sglang_argv(["python", "-m", "sglang.launch_server", "--model-path", str(model), *extra],
                             engine_version="0.5.23")
    q = spec_engine(spec).quantization_summary(spec)
    assert (q["method"], q["restore"]) == want, q


def test_dry_run_prints_the_quantization_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mxlaunch.cli.app import app

    model = checkpoint(tmp_path / "m", quantization_config=AWQ)
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    result = CliRunner().invoke(app, ["launch", "--dry-run", "--artifact-path", str(tmp_path / "store"), "--", *argv])
    assert result.exit_code == 0, result.output
    assert "quantization awq (checkpoint) restored raw" in " ".join(result.output.split()), result.output
