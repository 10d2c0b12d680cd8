"""Run inside SGLang's venv: SGLang's own quantized layers through mxlaunch's SGLang loader (issue 40).

For each case (a checkpoint folder, its dtype, SGLang's `--quantization` if any) this builds the model three
times with SGLang's own code — ModelConfig, `_initialize_model`, the quant method's create_weights, the model's
load_weights — and compares what each holds right after the weight step, before SGLang's post-processing:

    engine    SGLang's DefaultModelLoader (the oracle: what the default loader leaves)
    capture   mxlaunch's loader (plugin/sglang.py) with a capture plan: loads like the engine, writes the snapshot
    staged    mxlaunch's loader with a staged plan on the capture's files: no checkpoint read

`staged` must hold every tensor `engine` holds, by name, dtype, shape and bytes. Then SGLang's post-processing
runs for real; where this CPU cannot (no AMX, no CUDA kernels) the reason is reported, and where it can the
post-processed tensors are compared too.

    python tests/helpers/sglang_quant_oracle.py CASES.json OUT.json   (SGLANG_USE_CPU_ENGINE=1, the shim on PYTHONPATH)

CASES.json: [{"name", "model", "dtype", "quantization", "cuda_capability"}]. `cuda_capability` ([9, 0]) answers
torch.cuda.get_device_capability while the model is built: compressed-tensors asks it in create_weights
(`_check_scheme_supported`) on every device — nothing else of the build depends on it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

RAW: dict[str, dict] = {}  # phase → {name: (dtype, shape, bytes)} at the moment SGLang's post-processing starts
POST_ERRORS: dict[str, str] = {}


def snapshot(model: Any) -> dict[str, tuple[str, tuple, bytes]]:
    from mxlaunch.plugin.tensors import module_tensors, tensor_bytes

    out = {}
    for name, tensor in module_tensors(model):
        t = tensor.detach().cpu()
        out[name] = (str(t.dtype), tuple(t.shape), tensor_bytes(t).numpy().tobytes() if t.numel() else b"")
    return out


@contextmanager
def recording_postprocess(phase: str) -> Iterator[None]:
    """SGLang's post-processing, wrapped: the model's tensors are recorded first; a failure on this CPU is
    recorded (and the model left raw) instead of ending the run."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    real = DefaultModelLoader.postprocess_weights

    def record(model: Any, target_device: Any) -> None:
        RAW[phase] = snapshot(model)
        try:
            real(model, target_device)
        except Exception as exc:  # noqa: BLE001 - the CPU's limits, reported
            POST_ERRORS[phase] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"

    DefaultModelLoader.postprocess_weights = staticmethod(record)
    try:
        yield
    finally:
        DefaultModelLoader.postprocess_weights = real


@contextmanager
def cuda_capability(capability: list[int] | None) -> Iterator[None]:
    import torch

    if not capability:
        yield
        return
    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: tuple(capability)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = real


def _scalar(entry: tuple) -> float | None:
    """A one-element float32 tensor's value (the KV-cache scales), else None."""
    dtype, shape, raw = entry
    return struct.unpack("<f", raw)[0] if dtype == "torch.float32" and len(raw) == 4 else None


def compare(want: dict, got: dict) -> list[str]:
    problems = [f"missing {n}" for n in sorted(set(want) - set(got))]
    problems += [f"extra {n}" for n in sorted(set(got) - set(want))]
    for name in sorted(set(want) & set(got)):
        if want[name][:2] != got[name][:2]:
            problems.append(f"{name}: {got[name][:2]} != {want[name][:2]}")
        elif want[name][2] != got[name][2]:
            problems.append(f"{name}: bytes differ")
    return problems


def chosen_loaders(config: Any, plan: Any, run: Path) -> tuple[str, str]:
    """(SGLang's choice of loader, the hook's) for this checkpoint, the hook reading `plan` as a launch gives it."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from mxlaunch.plan import PLAN_ENV
    from mxlaunch.plugin.sglang import around_get_model_loader

    plan_file = run / "plan.json"
    plan_file.write_text(plan.to_json())
    os.environ[PLAN_ENV] = str(plan_file)
    try:
        factory = get_model_loader(LoadConfig(), config)
        hooked = around_get_model_loader(get_model_loader, LoadConfig(), config)
    finally:
        os.environ.pop(PLAN_ENV, None)
    return type(factory).__name__, type(hooked).__name__


def run_case(case: dict, work: Path, first: bool) -> dict:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from mxlaunch.plan import Plan, RankFile
    from mxlaunch.plugin.sglang import loader_class

    args = ServerArgs(model_path=case["model"], device="cpu", dtype=case["dtype"],
                      quantization=case.get("quantization"), kv_cache_dtype=case.get("kv_cache_dtype", "auto"))
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    if first:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mktemp(prefix="mx-sgq-"))
        initialize_model_parallel(backend="gloo")
    config = ModelConfig.from_server_args(args)
    device = DeviceConfig("cpu")
    RAW.clear()
    POST_ERRORS.clear()

    def build(loader: Any, phase: str) -> Any:
        with recording_postprocess(phase), cuda_capability(case.get("cuda_capability")):
            return loader.load_model(model_config=config, device_config=device)

    engine = build(DefaultModelLoader(LoadConfig()), "engine")
    run = work / case["name"]
    capture_dir = run / "capture"
    run.mkdir(parents=True)
    plan = Plan(strategy="capture", source_id="0" * 16, run_dir=str(run), capture_dir=str(capture_dir),
                wait_timeout_s=5)
    factory, hooked = chosen_loaders(config, plan, run)
    captured = build(loader_class()(LoadConfig(), plan, 0), "capture")
    files = sorted((capture_dir / "0").glob("*.safetensors"))
    staged_plan = Plan(strategy="staged", source_id="0" * 16, run_dir=str(run), wait_timeout_s=5,
                       ranks={"0": [RankFile(path=str(f), bytes=f.stat().st_size) for f in files]},
                       fallback_ok=False)
    loader = loader_class()(LoadConfig(), staged_plan, 0)
    staged = build(loader, "staged")
    outcome = loader._outcome
    layer = engine.model.layers[0].self_attn.qkv_proj
    experts = dict(engine.named_modules()).get("model.layers.0.block_sparse_moe.experts")  # a Mixtral's FusedMoE
    result = {
        "name": case["name"],
        "quant_method": type(getattr(layer, "quant_method", None)).__name__,
        "scheme": type(getattr(layer, "scheme", None)).__name__,  # compressed-tensors: the scheme SGLang chose
        "factory": factory,  # the loader SGLang's get_model_loader picks for this checkpoint
        "hooked": hooked,  # what mxlaunch's hook around it hands back under a capture plan
        "capture_files": len(files),
        "staged_strategy": getattr(outcome, "strategy", None),
        "staged_bytes": getattr(outcome, "bytes", None),
        "raw_tensors": len(RAW.get("engine", {})),
        "raw_dtypes": sorted({v[0] for v in RAW.get("engine", {}).values()}),
        "qkv_raw": {n: list(v[:2]) for n, v in RAW.get("engine", {}).items() if "layers.0.self_attn.qkv_proj" in n},
        "moe_method": type(getattr(experts, "quant_method", None)).__name__ if experts is not None else None,
        "experts_raw": {n.rsplit(".", 1)[1]: list(v[:2]) for n, v in RAW.get("engine", {}).items()
                        if "layers.0.block_sparse_moe.experts." in n},
        "attn_raw": {n: [*v[:2], _scalar(v)] for n, v in RAW.get("engine", {}).items()
                     if "layers.0.self_attn.attn." in n},
        "raw_vs_engine": {p: compare(RAW["engine"], RAW[p]) if p in RAW else ["no weight step"]
                          for p in ("capture", "staged")},
        "post_errors": dict(POST_ERRORS),
    }
    if not POST_ERRORS:
        want = snapshot(engine)
        result["post_vs_engine"] = {p: compare(want, snapshot(m)) for p, m in (("capture", captured),
                                                                                ("staged", staged))}
    return result


def main(cases_path: str, out_path: str) -> int:
    cases = json.loads(Path(cases_path).read_text())
    results = []
    with tempfile.TemporaryDirectory(prefix="mx-sgq-") as tmp:
        for i, case in enumerate(cases):
            try:
                results.append(run_case(case, Path(tmp), first=(i == 0)))
            except Exception as exc:  # noqa: BLE001 - reported per case, the test says which failed
                results.append({"name": case["name"], "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()[-3000:]})
    Path(out_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
