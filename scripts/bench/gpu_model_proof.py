"""Proof on a GPU with real models (issue 11): capture → stage → restore through the plugin core, logits exact.

The engines' CUDA builds cannot travel to the GPU machine, so the proof uses transformers models built
from a config there (random weights, no downloads): a Llama of ≥ 1 GiB bf16 and a Qwen2 with tied
embeddings and q/k/v biases. For each: logits of the model as built (gold) → `capture_tensors` of its
CUDA tensors (the same core the vLLM and SGLang adapters call) → `mxlaunch stage` into /dev/shm →
`restore_tensors` into a freshly built model with other random weights (whose logits differ first) →
`torch.equal` on the logits, ties still tied. Writes JSON.

    python scripts/bench/gpu_model_proof.py --out proof.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mxlaunch.plugin import gpu_restore  # noqa: E402
from mxlaunch.plugin import capture_prepare  # noqa: E402
from mxlaunch.plugin.capture_prepare import PreparedCapture  # noqa: E402
from mxlaunch.plugin.loader import capture_tensors, module_tensors, restore_tensors  # noqa: E402

GiB = 1 << 30


def configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config

    return {
        "llama-1.6GiB": LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                    max_position_embeddings=2048),
        "qwen2-tied-bias": Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=2, vocab_size=32000,
                                       tie_word_embeddings=True, max_position_embeddings=2048),
    }


def build(cfg, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    return model.to("cuda").eval()


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="proof.json")
    ap.add_argument("--work", default="/dev/shm/mx-proof")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    res: dict = {"machine": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "models": {}}
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(3)).cuda()
    for name, cfg in configs().items():
        row: dict = {}
        model = build(cfg, seed=0)
        gold = logits(model, ids)
        row["again_equal"] = bool(torch.equal(gold, logits(model, ids)))
        cap = work / name / "capture"
        # as RankLoad.capture does: the parts laid out and page-locked while the engine loads, then the copies
        prep = PreparedCapture.start(module_tensors(model), cap)
        c = capture_tensors(module_tensors(model), cap, prepared=prep)
        row["capture"] = {"gib": c.bytes / GiB, "tensors": c.tensors, "files": len(c.files),
                          "seconds": round(c.seconds, 3), "gibps": c.bytes / GiB / c.seconds, "prepared": c.prepared,
                          "release_seconds": round(capture_prepare.release_pending(), 4)}
        del model
        torch.cuda.empty_cache()
        staged = work / name / "staged"
        p = subprocess.run([sys.executable, "-m", "mxlaunch.cli", "stage", str(cap), "--dest", str(staged)],
                           cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"stage failed: {p.stderr[-1500:]}")
        files = sorted(str(f) for f in staged.rglob("*.safetensors"))
        for source, paths in (("staged", files), ("capture", sorted(str(f) for f in cap.glob("*.safetensors")))):
            # as the adapters do: prepare() first (registers the staged files), then build, then restore
            t = time.perf_counter()
            gpu_restore.prepare(torch.cuda.current_device(), paths, timeout_s=10)
            fresh = build(cfg, seed=1)
            build_seconds = time.perf_counter() - t
            before = bool(torch.equal(gold, logits(fresh, ids)))
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = restore_tensors(module_tensors(fresh), paths, wait_timeout_s=10)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
            unpin = gpu_restore.release_pending()
            after = logits(fresh, ids)
            tied = None
            if getattr(cfg, "tie_word_embeddings", False):
                tied = fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
            row[f"restore_{source}"] = {
                "equal_before_restore": before, "logits_equal": bool(torch.equal(gold, after)),
                "max_abs_diff": float((gold - after).abs().max()), "tied_still_tied": tied,
                "gib": r.bytes / GiB, "tensors": r.tensors, "seconds": round(seconds, 4),
                "gibps": r.bytes / GiB / seconds, "gpu": r.gpu, "model_build_seconds": round(build_seconds, 3),
                "unpin_seconds_after": round(unpin, 4)}
            del fresh
            torch.cuda.empty_cache()
        res["models"][name] = row
        print(name, json.dumps(row), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    ok = all(r[f"restore_{s}"]["logits_equal"] and not r[f"restore_{s}"]["equal_before_restore"]
             for r in res["models"].values() for s in ("staged", "capture"))
    ok = ok and all(r["capture"]["prepared"] is not None for r in res["models"].values())
    res["all_exact"] = ok
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("ALL EXACT" if ok else "MISMATCH", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
