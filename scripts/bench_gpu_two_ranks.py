"""Two GPUs restoring at once (issue 11): aggregate GiB/s of two ranks against two concurrent pinned copies.

One process per GPU, as an engine runs one worker per GPU. Each makes one Llama-70B TP4 rank (12.14 GiB)
on its GPU, captures it into /dev/shm and stages it back with `mxlaunch stage` (2 MiB pages); then, with
both processes released by one barrier: (1) the ceiling — each copies one pinned 4 GiB buffer to its GPU
3 times; (2) mxlaunch's default path — prepare() (early registration of the staged files + ring) and the
restore, bytes checked with torch.equal. Aggregate = both ranks' bytes / (last end − first start).

    python scripts/bench_gpu_two_ranks.py --out two_ranks.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def worker(rank: int, layers: int, barrier, out) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch

    from bench_gpu_load import rank_tensors
    from mxlaunch.plugin import gpu_restore
    from mxlaunch.plugin.loader import capture_tensors, restore_tensors

    torch.cuda.set_device(rank)
    work = Path(f"/dev/shm/mx-two-{rank}")
    shutil.rmtree(work, ignore_errors=True)
    named = rank_tensors(layers)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    cap = capture_tensors(named, work / "capture")
    p = subprocess.run([sys.executable, "-m", "mxlaunch.cli", "stage", str(work / "capture"), "--dest",
                        str(work / "staged")], cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-1000:])
    files = sorted(str(f) for f in (work / "staged").rglob("*.safetensors"))
    dests = {n: torch.empty_like(t) for n, t in named}
    pin = torch.empty(4 * GiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    row: dict = {"rank": rank, "bytes": nbytes, "capture_seconds": cap.seconds}
    spans = []
    for _ in range(3):
        barrier.wait()
        torch.cuda.synchronize()
        t0 = time.time()
        dev.copy_(pin, non_blocking=True)
        torch.cuda.synchronize()
        spans.append((t0, time.time()))
    row["ceiling_spans"] = spans
    del pin, dev
    runs = []
    for _ in range(3):
        for t in dests.values():
            t.zero_()
        gpu_restore.prepare(rank, files, timeout_s=10)
        gpu_restore._registrar.wait()
        gpu_restore._early._thread.join()
        torch.cuda.synchronize()
        barrier.wait()
        t0 = time.time()
        r = restore_tensors(list(dests.items()), files, wait_timeout_s=10)
        torch.cuda.synchronize()
        t1 = time.time()
        gpu_restore.release_pending()
        ok = all(torch.equal(dests[n], t) for n, t in named)
        runs.append({"span": (t0, t1), "exact": ok, "gpu": r.gpu})
    row["restore_runs"] = runs
    shutil.rmtree(work, ignore_errors=True)
    out.put(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--out", default="two_ranks.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.layers, barrier, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted([out.get(timeout=500) for _ in procs], key=lambda r: r["rank"])
    for p in procs:
        p.join()
    total_ceiling = 2 * 4 * GiB
    ceil = [total_ceiling / GiB / (max(r["ceiling_spans"][i][1] for r in rows) - min(r["ceiling_spans"][i][0] for r in rows))
            for i in range(3)]
    total = sum(r["bytes"] for r in rows)
    mx = [total / GiB / (max(r["restore_runs"][i]["span"][1] for r in rows) - min(r["restore_runs"][i]["span"][0] for r in rows))
          for i in range(3)]
    res = {"ceiling_two_pinned_copies_gibps": ceil, "mxlaunch_two_ranks_gibps": mx,
           "ratio_median": sorted(mx)[1] / sorted(ceil)[1],
           "exact": all(run["exact"] for r in rows for run in r["restore_runs"]), "ranks": rows,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "ranks"}, indent=1))


if __name__ == "__main__":
    main()
