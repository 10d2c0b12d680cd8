#!/usr/bin/env python3
"""What CUDA IPC gives between two processes on ONE GPU, without NIXL/UCX (issue 23's slow same-GPU pull).

The source process allocates --gib GiB as --tensors tensors on cuda:0 (random bytes), exports each through
torch's CUDA IPC reductions (cudaIpcGetMemHandle under the hood) into a file and waits; the target opens them
and copies every tensor into its own allocation, --reps times, timed with CUDA events, then checks the bytes
(torch.equal against the source's mapped tensors). The same copies inside one process are the ceiling.

    python3 scripts/probes/probe_same_gpu_ipc.py --gib 8 --tensors 363 --out $OUT/same_gpu_ipc.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30


def source(args: argparse.Namespace) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    per = int(args.gib * GiB) // args.tensors // 2  # bf16 elements
    tensors = [torch.empty(per, dtype=torch.bfloat16, device="cuda:0").normal_() for _ in range(args.tensors)]
    torch.cuda.synchronize()
    Path(args.handles).write_bytes(pickle.dumps([reduce_tensor(t) for t in tensors]))
    print("serving", flush=True)
    sys.stdin.readline()


def target(args: argparse.Namespace) -> None:
    import torch

    t0 = time.perf_counter()
    remote = [fn(*fargs) for fn, fargs in pickle.loads(Path(args.handles).read_bytes())]
    open_s = time.perf_counter() - t0
    mine = [torch.empty_like(r) for r in remote]
    total = sum(r.numel() * r.element_size() for r in remote)

    def timed(src: list, dst: list) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s, d in zip(src, dst):
            d.copy_(s, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    ipc = [timed(remote, mine) for _ in range(args.reps)]
    exact = all(torch.equal(a, b) for a, b in zip(remote, mine))
    local = [t.clone() for t in mine]
    same_process = [timed(local, mine) for _ in range(args.reps)]
    print(json.dumps({"bytes": total, "tensors": len(remote), "open_s": round(open_s, 4),
                      "ipc_copy_s": [round(s, 4) for s in ipc], "ipc_gibps": [round(total / GiB / s, 1) for s in ipc],
                      "same_process_gibps": [round(total / GiB / s, 1) for s in same_process], "exact": exact}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--tensors", type=int, default=363)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--role", default="")
    ap.add_argument("--handles", default="/tmp/mx-ipc-handles.pkl")
    args = ap.parse_args()
    if args.role == "source":
        source(args)
        return 0
    if args.role == "target":
        target(args)
        return 0
    base = [sys.executable, __file__, "--gib", str(args.gib), "--tensors", str(args.tensors), "--reps", str(args.reps),
            "--handles", args.handles]
    src = subprocess.Popen(base + ["--role", "source"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if src.stdout.readline().strip() != "serving":
            raise SystemExit("the source did not start")
        out = subprocess.run(base + ["--role", "target"], capture_output=True, text=True, timeout=300)
        if out.returncode:
            raise SystemExit(f"the target failed: {out.stderr[-2000:]}")
        rec = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        src.stdin.write("\n")
        src.stdin.flush()
        src.wait(timeout=60)
    rec["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(rec, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
