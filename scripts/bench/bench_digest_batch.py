"""mx128 over a rank's many tensors: one tensor at a time against the batched form (transfer/digest.py `digests`).

Why: on an H100 a P2P pull's checksum step took 0.31–0.48 s of a 0.40–0.64 s weight phase whose transfer took
0.004–0.02 s (docs/benchmarks.md, session 29): ~30 kernel launches and a synchronisation per tensor, for a rank
of 500–650 tensors. The tensors here have the sizes of such a rank: a 4-bit Llama layer's packed weights, scales,
zeros and act-order indices, plus norms, repeated --layers times (the 2 GiB Llama of the GPU harness: 23 layers).
Both forms are timed in the same run on the same tensors (median of --reps, the device synchronised), their
digests checked equal. On the GPU when there is one (the algorithm the GPU path uses), else on the CPU.

    python scripts/bench/bench_digest_batch.py --out digest_batch.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def layer_shapes(hidden: int, inter: int, group: int) -> list[tuple[int, ...]]:
    """A GPTQ 4-bit layer's tensors (int32 packed): qweight, scales, qzeros, g_idx for 7 Linears, 2 norms."""
    out = []
    for n_in, n_out in [(hidden, hidden)] * 4 + [(hidden, inter)] * 2 + [(inter, hidden)]:
        out += [(n_in // 8, n_out), (n_in // group, n_out), (n_in // group, n_out // 8), (n_in,)]
    return out + [(hidden,), (hidden,)]


def main(argv: list[str] | None = None) -> int:
    import torch

    from mxlaunch.transfer.digest import MIX, digest, digests

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=23)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5504)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    g = torch.Generator().manual_seed(0)
    shapes = layer_shapes(args.hidden, args.inter, 128) * args.layers
    tensors = [torch.randint(-2**31, 2**31 - 1, s, dtype=torch.int32, generator=g).to(args.device) for s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def timed(fn) -> tuple[float, list[str]]:
        times, got = [], []
        for _ in range(args.reps + 1):  # the first is a warm-up (allocator, kernels)
            sync()
            started = time.perf_counter()
            got = fn()
            sync()
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:]), got

    one_s, one = timed(lambda: [digest(t, MIX) for t in tensors])
    batch_s, batched = timed(lambda: digests(tensors, [MIX] * len(tensors)))
    result = {
        "bench": "digest_batch", "date": time.strftime("%Y-%m-%d"), "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or platform.machine(),
        "cores": __import__("os").cpu_count(), "torch": torch.__version__, "tensors": len(tensors), "bytes": nbytes,
        "reps": args.reps, "per_tensor_s": round(one_s, 4), "batched_s": round(batch_s, 4),
        "speedup": round(one_s / batch_s, 2) if batch_s else None, "equal": one == batched,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
