"""What the P2P checksums cost on this machine's CPU, against a copy of the same bytes (issue 29).

A source computes one checksum per tensor it serves at publish; a target recomputes them over what it
pulled before it serves (transfer/digest.py). Here: the raw layout of the tests' "big" model (the same
tensors a test source serves), each tensor hashed with xxh3-128 (host memory's algorithm), and one
tensor (16 MiB) with mx128 (the GPU algorithm, run in torch on the CPU: why host memory does not use it). The
baseline, measured in the same run: a copy of the same tensors into memory allocated and touched before
(what a pull into a model's host memory costs at best). Best of --reps. Writes JSON.

    python scripts/bench/bench_checksum_cost.py --out checksum_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from mxlaunch.plugin.loader import module_tensors
    from mxlaunch.transfer.digest import MIX, XXH3, digest
    from tests.helpers.p2p_models import build

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mix-mib", type=int, default=16, help="size of the mx128 tensor (slow on a CPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    tensors = [t for _, t in module_tensors(build(0, "big", post=False))]
    total = sum(t.numel() * t.element_size() for t in tensors)
    targets = [torch.empty_like(t) for t in tensors]
    for d, t in zip(targets, tensors):
        d.copy_(t)  # touched once: the timed copies move bytes, they do not fault pages in
    copy_s = best(lambda: [d.copy_(t) for d, t in zip(targets, tensors)], args.reps)
    xxh_s = best(lambda: [digest(t, XXH3) for t in tensors], args.reps)
    mixed = torch.randn((args.mix_mib * MiB) // 4)
    mix_s = best(lambda: digest(mixed, MIX), 1)
    result = {
        "machine": f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} torch threads)",
        "date": time.strftime("%Y-%m-%d"),
        "tensors": len(tensors), "mib": round(total / MiB, 1),
        "copy_seconds": round(copy_s, 4), "copy_mib_s": round(total / MiB / copy_s),
        "xxh3_seconds": round(xxh_s, 4), "xxh3_mib_s": round(total / MiB / xxh_s),
        "xxh3_vs_copy": round(xxh_s / copy_s, 2),
        "mx128_cpu_mib": args.mix_mib, "mx128_cpu_seconds": round(mix_s, 3),
        "mx128_cpu_mib_s": round(args.mix_mib / mix_s, 1),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
