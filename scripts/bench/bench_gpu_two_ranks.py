"""N GPUs restoring at once (issues 11, 16): aggregate GiB/s of N ranks against N concurrent pinned copies.

One process per GPU, as an engine runs one worker per GPU. Each makes one Llama-70B rank on its GPU
(TP4 shapes for two ranks, as in issue 11's runs — 12.14 GiB for 28 layers; TP-N shapes for N ≥ 4),
captures it into /dev/shm and stages it back with `mxlaunch stage` (2 MiB pages); then, with every process
released by one barrier: (1) the ceiling — each copies one pinned 4 GiB buffer to its GPU 3 times, and
once more with as many bytes as its rank (up to 16 GiB); (2) mxlaunch's default path — prepare() (early
registration of the staged files + ring) and the restore, bytes checked with torch.equal.
Aggregate = all ranks' bytes / (last end − first start); the per-rank spread is each rank's own GiB/s.

    python scripts/bench/bench_gpu_two_ranks.py --out two_ranks.json [--numa both]
    python scripts/bench/bench_gpu_load.py --ranks 8 --layers 80 --out eight.json    # a whole TP8 node (issue 16)

`--numa local` pins each worker (and the `mxlaunch stage` it runs, so the staged files' pages) to the
CPUs of its GPU's NUMA node; `both` runs the default and the local placement one after the other.
The GPUs' NUMA nodes and `nvidia-smi topo -m` are recorded.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def numa_node_of_gpu(index: int) -> int:
    """The NUMA node of GPU `index` from sysfs, by the PCI address nvidia-smi reports (-1 when unknown)."""
    r = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                       capture_output=True, text=True)
    bus = r.stdout.strip().lower()  # "00000000:18:00.0": an 8-digit domain, sysfs has 4
    if r.returncode or ":" not in bus:
        return -1
    domain, _, rest = bus.partition(":")
    try:
        return int(Path(f"/sys/bus/pci/devices/{int(domain, 16):04x}:{rest}/numa_node").read_text())
    except (OSError, ValueError):
        return -1


def node_cpus(node: int) -> set[int]:
    cpus: set[int] = set()
    text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    for piece in text.split(","):
        lo, _, hi = piece.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def huge_fraction(files: list[str]) -> float:
    """Share of the staged files' bytes that sit in 2 MiB pages (ShmemPmdMapped of a populated mapping)."""
    from mxlaunch.memory.hugepages import FileMapping, _libc

    huge = total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        m = FileMapping(fd, size, writable=False)
        _libc.madvise(m.addr, size, 22)  # MADV_POPULATE_READ
        lines = Path("/proc/self/smaps").read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"{m.addr:x}-"):
                for follow in lines[i + 1:i + 30]:
                    if follow.startswith("ShmemPmdMapped:") or follow.startswith("FilePmdMapped:"):
                        huge += int(follow.split()[1]) << 10
                break
        total += size
        m.close()
        os.close(fd)
    return huge / total if total else 0.0


def pinned_spans(nbytes: int, barrier, reps: int = 3) -> list[tuple[float, float]]:
    """One pinned buffer → this GPU, `reps` times, each released by the barrier: (start, end) wall times."""
    import torch

    pin = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    spans = []
    for _ in range(reps):
        barrier.wait()
        torch.cuda.synchronize()
        t0 = time.time()
        dev.copy_(pin, non_blocking=True)
        torch.cuda.synchronize()
        spans.append((t0, time.time()))
    return spans


def prepare_restore(rank: int, files: list[str], dests: dict) -> None:
    """As the adapters do while the engine builds the model: prepare() registers the staged files (and pins
    the ring); here it is waited for, as a model build would outlast it. The destinations are zeroed."""
    import torch

    from mxlaunch.plugin import gpu_restore

    for t in dests.values():
        t.zero_()
    gpu_restore.prepare(rank, files, timeout_s=10)
    gpu_restore._registrar.wait()
    gpu_restore._early._thread.join()
    torch.cuda.synchronize()


def worker(rank: int, layers: int, barrier, out, numa: str = "default", span_mib: int = 0, ranks: int = 2,
           tp: int = 4) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import torch

    node = numa_node_of_gpu(rank)
    if numa == "local" and node >= 0:
        os.sched_setaffinity(0, node_cpus(node))  # threads, the stage child and tmpfs pages follow

    from gpu_shapes import rank_tensors
    from mxlaunch.plugin import gpu_restore
    from mxlaunch.plugin.loader import capture_tensors, restore_tensors

    torch.cuda.set_device(rank)
    work = Path(f"/dev/shm/mx-two-{rank}")
    shutil.rmtree(work, ignore_errors=True)
    named = rank_tensors(layers, tp=tp)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    cap = capture_tensors(named, work / "capture")
    p = subprocess.run([sys.executable, "-m", "mxlaunch.cli", "stage", str(work / "capture"), "--dest",
                        str(work / "staged")], cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-1000:])
    files = sorted(str(f) for f in (work / "staged").rglob("*.safetensors"))
    shutil.rmtree(work / "capture", ignore_errors=True)  # the staged copy is what is restored: half the RAM
    if span_mib:
        from mxlaunch.plugin import early_register

        early_register.SPAN = span_mib << 20
    dests = {n: torch.empty_like(t) for n, t in named}
    row: dict = {"rank": rank, "bytes": nbytes, "capture_seconds": cap.seconds, "numa_node": node,
                 "cpus": len(os.sched_getaffinity(0)), "capture": cap.prepared, "span_mib": span_mib,
                 "staged_huge_fraction": huge_fraction(files)}
    row["ceiling_spans"] = pinned_spans(4 * GiB, barrier)
    # the same ceiling with as many bytes as the rank (a larger working set for the host's DMA)
    row["ceiling_rank_bytes"] = min(nbytes, 16 * GiB)
    row["ceiling_rank_bytes_spans"] = pinned_spans(row["ceiling_rank_bytes"], barrier)
    runs = []
    solo = []
    for turn in range(ranks if ranks <= 2 else 1):  # rank(s) alone first (the others wait), then all at once
        prepare_restore(rank, files, dests)
        barrier.wait()
        if turn == rank:
            t0 = time.time()
            r = restore_tensors(list(dests.items()), files, wait_timeout_s=10)
            torch.cuda.synchronize()
            solo.append({"seconds": time.time() - t0, "gpu": r.gpu})
        else:  # this rank sits out: release its registrations
            gpu_restore._registrar.stop()
            gpu_restore._registrar = None
        barrier.wait()
        gpu_restore.release_pending()
    row["solo"] = solo
    for _ in range(3):
        prepare_restore(rank, files, dests)
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


def aggregate(nbytes: float, spans: list) -> float:
    """GiB/s of `nbytes` moved by spans (start, end) that ran at once: last end − first start."""
    return nbytes / GiB / (max(e for _, e in spans) - min(s for s, _ in spans))


def one_variant(layers: int, numa: str, span_mib: int = 0, ranks: int = 2, tp: int = 4) -> dict:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, layers, barrier, out, numa, span_mib, ranks, tp)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = sorted([out.get(timeout=900) for _ in procs], key=lambda r: r["rank"])
    for p in procs:
        p.join()
    ceil = [aggregate(ranks * 4 * GiB, [r["ceiling_spans"][i] for r in rows]) for i in range(3)]
    total = sum(r["bytes"] for r in rows)
    ceil_rank = [aggregate(sum(r["ceiling_rank_bytes"] for r in rows), [r["ceiling_rank_bytes_spans"][i] for r in rows])
                 for i in range(3)]
    mx = [aggregate(total, [r["restore_runs"][i]["span"] for r in rows]) for i in range(3)]
    per_rank = [[r["bytes"] / GiB / (r["restore_runs"][i]["span"][1] - r["restore_runs"][i]["span"][0]) for r in rows]
                for i in range(3)]
    res = {"numa": numa, "span_mib": span_mib, "ranks_count": ranks, "tp_shapes": tp, "layers": layers,
           "gib_per_rank": rows[0]["bytes"] / GiB, "huge": [r["staged_huge_fraction"] for r in rows],
           "numa_nodes": [r["numa_node"] for r in rows], "cpus_per_rank": [r["cpus"] for r in rows],
           "ceiling_two_pinned_copies_gibps": ceil, "mxlaunch_two_ranks_gibps": mx,
           "ratio_median": sorted(mx)[1] / sorted(ceil)[1],
           "ceiling_two_pinned_copies_rank_bytes_gibps": ceil_rank,
           "ratio_median_rank_bytes": sorted(mx)[1] / sorted(ceil_rank)[1],
           "per_rank_gibps": per_rank,
           "per_rank_spread": [round(max(x) / min(x), 3) for x in per_rank],
           "exact": all(run["exact"] for r in rows for run in r["restore_runs"]), "ranks": rows}
    print(json.dumps({k: v for k, v in res.items() if k != "ranks"}, indent=1), flush=True)
    return res


def run(ranks: int, layers: int, numa: str, span_mib: str, out: str, tp: int = 0) -> dict:
    """Every variant (NUMA placement × early-registration span) with `ranks` processes; JSON into `out`."""
    import torch

    have = torch.cuda.device_count()
    if ranks < 1 or ranks > have:
        raise SystemExit(f"--ranks {ranks}: this machine has {have} GPU(s) — ask for at most {have}")
    tp = tp or (4 if ranks <= 2 else ranks)
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    variants = ("default", "local") if numa == "both" else (numa,)
    res = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "topo": topo,
           "machine": torch.cuda.get_device_name(0), "gpus": have, "cpus": os.cpu_count(),
           "variants": [one_variant(layers, v, int(span), ranks, tp) for v in variants for span in span_mib.split(",")]}
    first = res["variants"][0]
    res.update({k: first[k] for k in ("ceiling_two_pinned_copies_gibps", "mxlaunch_two_ranks_gibps", "ratio_median",
                                      "per_rank_spread", "exact")})
    Path(out).write_text(json.dumps(res, indent=1))
    print(topo)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ranks", type=int, default=2, help="processes, one per GPU")
    ap.add_argument("--tp", type=int, default=0, help="Llama-70B TP degree of the shapes (default: 4 for ≤ 2 ranks, else N)")
    ap.add_argument("--out", default="two_ranks.json")
    ap.add_argument("--numa", choices=("default", "local", "both"), default="default")
    ap.add_argument("--span-mib", default="0", help="comma list: early-registration span(s) in MiB to compare (0 = default)")
    args = ap.parse_args()
    run(args.ranks, args.layers, args.numa, args.span_mib, args.out, args.tp)

if __name__ == "__main__":
    main()
