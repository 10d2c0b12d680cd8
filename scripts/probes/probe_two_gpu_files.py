"""Two GPUs restoring at once, taken apart (issue 11): which part of the restore's pattern loses bandwidth.

One process per GPU, each with one Llama-70B TP4 rank (12.14 GiB) captured into /dev/shm through
`PreparedCapture` (2 MiB pages). Released together by a barrier, 3 times each:
  A. a pinned buffer of the rank's size → one GPU buffer, one copy (the ceiling);
  B. each registered file → its own GPU buffer, one copy per file (15 big copies);
  C. each tensor from its registered file → its own tensor (171 copies: the restore's pattern, no mxlaunch code);
  D. mxlaunch's default restore (`prepare()` + `restore_tensors`).
Aggregate GiB/s = both ranks' bytes / (last end − first start). Also each process alone for C. Writes JSON.

    python scripts/probes/probe_two_gpu_files.py --out probe_two.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def worker(rank: int, barrier, out) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import shutil

    import torch

    from gpu_shapes import rank_tensors
    from bench_gpu_two_ranks import prepare_restore
    from mxlaunch.plugin import capture_prepare, gpu_restore
    from mxlaunch.plugin.capture_prepare import PreparedCapture
    from mxlaunch.plugin.early_register import register_file
    from mxlaunch.plugin.loader import capture_tensors, read_header, restore_tensors

    torch.cuda.set_device(rank)
    work = Path(f"/dev/shm/mx-probe-two-{rank}")
    shutil.rmtree(work, ignore_errors=True)
    named = rank_tensors(28)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    prep = PreparedCapture.start(named, work)
    capture_tensors(named, work, prepared=prep)
    capture_prepare.release_pending()
    files = sorted(str(p) for p in work.glob("*.safetensors"))
    dests = {n: torch.empty_like(t) for n, t in named}
    gold = dict(named)
    spans: dict[str, list] = {}

    def timed(label: str, fn, reps: int = 3, alone: bool = False) -> None:
        for _ in range(reps):
            barrier.wait()
            if alone and rank != 0:
                barrier.wait()
            torch.cuda.synchronize()
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            spans.setdefault(label, []).append((t0, time.time()))
            if alone and rank == 0:
                barrier.wait()

    pin = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    timed("A pinned buffer, one copy", lambda: dev.copy_(pin, non_blocking=True))
    pin = dev = None  # the rank's tensors need the room
    regs = [register_file(f, rank, span=1 << 40) for f in files]
    srcs = [torch.frombuffer(r.mapping.view, dtype=torch.uint8) for r in regs]
    bufs = [torch.empty(r.size, dtype=torch.uint8, device="cuda") for r in regs]

    def per_file() -> None:
        for s, b in zip(srcs, bufs):
            b.copy_(s, non_blocking=True)
    timed("B one copy per file (15)", per_file)
    bufs = []
    torch.cuda.empty_cache()
    pieces = []
    for f, s in zip(files, srcs):
        for e in read_header(f).entries:
            pieces.append((s[e.begin:e.end], dests[e.name].view(-1).view(torch.uint8)))

    def per_tensor() -> None:
        for s, d in pieces:
            d.copy_(s, non_blocking=True)
    timed("C one copy per tensor (171)", per_tensor)
    ok_c = all(torch.equal(dests[n], gold[n]) for n in gold)
    timed("C alone (rank 0 then rank 1)", per_tensor, reps=1, alone=True)
    pieces.clear()
    srcs = []
    s = None  # noqa: F841 - the last file's tensor view goes before its mapping
    for r in regs:
        try:
            r.release()
        except BufferError:  # a view still alive: leave it mapped, the process ends soon
            pass

    def mx() -> None:
        restore_tensors(list(dests.items()), files, wait_timeout_s=10)
    for _ in range(3):
        prepare_restore(rank, files, dests)
        timed("D mxlaunch default restore", mx, reps=1)
        gpu_restore.release_pending()
    ok_d = all(torch.equal(dests[n], gold[n]) for n in gold)
    shutil.rmtree(work, ignore_errors=True)
    out.put({"rank": rank, "bytes": nbytes, "spans": spans, "exact_c": ok_c, "exact_d": ok_d})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_two.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, barrier, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted([out.get(timeout=500) for _ in procs], key=lambda r: r["rank"])
    for p in procs:
        p.join()
    total = sum(r["bytes"] for r in rows)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "exact": all(r["exact_c"] and r["exact_d"] for r in rows),
                 "aggregate_gibps": {}, "per_rank_seconds": {}}
    for label in rows[0]["spans"]:
        n = len(rows[0]["spans"][label])
        if label.startswith("C alone"):
            res["per_rank_seconds"][label] = [r["spans"][label][0][1] - r["spans"][label][0][0] for r in rows]
            continue
        agg = [total / GiB / (max(r["spans"][label][i][1] for r in rows) - min(r["spans"][label][i][0] for r in rows))
               for i in range(n)]
        res["aggregate_gibps"][label] = {"median": statistics.median(agg), "all": agg}
        res["per_rank_seconds"][label] = [[round(s[1] - s[0], 4) for s in r["spans"][label]] for r in rows]
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
