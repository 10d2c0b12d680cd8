"""Which host memory copies to a GPU at the link's speed on this host (issue 11, the two-GPU gap).

For each kind of host memory, one 4 GiB source copied to one GPU buffer (median of 3, after one warm-up):
torch's pinned buffer (cudaHostAlloc), an anonymous 2 MiB-page buffer registered with cudaHostRegister
(`pinned.HostBuffer`, mxlaunch's ring), a tmpfs file laid out in 2 MiB pages and registered (what
`mxlaunch stage` + early registration give), the same with 4 KiB pages; then the 2 MiB-page file copied
as 16 MiB … 256 MiB pieces on 1, 2 and 4 streams. `--gpus 2` runs every case on both GPUs at once too
(one thread per GPU, released together). Writes JSON.

    python scripts/probes/probe_host_dma.py --out probe_dma.json [--gpus 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mxlaunch.plugin import pinned  # noqa: E402
from mxlaunch.memory.hugepages import FileMapping, HugePager, _libc  # noqa: E402

GiB = 1 << 30
N = 4 * GiB


def tmpfs_file(path: Path, huge: bool) -> tuple[int, FileMapping]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, N)
    m = FileMapping(fd, N)
    if huge:
        pager = HugePager(max_cpu_s_per_gib=10.0)
        for b in range(0, N, 64 << 20):
            pager.prepare(m, fd, b, b + (64 << 20))
    _libc.madvise(m.addr, N, 23)
    return fd, m


def sources(gpu: int, work: Path) -> dict:
    """name → (uint8 host tensor, closer)."""
    torch.cuda.set_device(gpu)
    out = {}
    t = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    t.fill_(1)
    out["torch pinned (cudaHostAlloc)"] = (t, lambda: None)
    hb = pinned.HostBuffer(N)
    hb.tensor.fill_(2)
    out["anonymous 2 MiB pages, registered"] = (hb.tensor, hb.close)
    for huge in (True, False):
        fd, m = tmpfs_file(work / f"f{gpu}-{int(huge)}", huge)
        t0 = time.perf_counter()
        pinned.register(m.addr, N, read_only=True)
        reg_s = time.perf_counter() - t0
        ten = torch.frombuffer(m.view, dtype=torch.uint8)

        def close(m=m, fd=fd) -> None:
            pinned.unregister(m.addr)
            m.close()
            os.close(fd)
        out[f"tmpfs file, {'2 MiB' if huge else '4 KiB'} pages, registered ({reg_s:.2f} s to register)"] = (ten, close)
    return out


def copy_rate(src: torch.Tensor, dst: torch.Tensor, piece: int = 0, streams: int = 1) -> float:
    ss = [torch.cuda.Stream() for _ in range(streams)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if not piece:
        dst.copy_(src, non_blocking=True)
    else:
        for i, b in enumerate(range(0, N, piece)):
            with torch.cuda.stream(ss[i % streams]):
                dst[b:b + piece].copy_(src[b:b + piece], non_blocking=True)
    torch.cuda.synchronize()
    return N / GiB / (time.perf_counter() - t0)


def cases(src_map: dict) -> list[tuple[str, str, int, int]]:
    huge = next(k for k in src_map if k.startswith("tmpfs file, 2 MiB"))
    out = [(k, k, 0, 1) for k in src_map]
    for piece in (16 << 20, 256 << 20):
        for streams in (1, 2, 4):
            out.append((f"{huge.split(' (')[0]}: {piece >> 20} MiB pieces on {streams} stream(s)", huge, piece, streams))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_dma.json")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--work", default="/dev/shm/mx-probe-dma")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": torch.cuda.get_device_name(0), "gpus": args.gpus, "cpus": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d"), "single": {}, "together": {}}
    srcs = [sources(g, work) for g in range(args.gpus)]
    dsts = []
    for g in range(args.gpus):
        torch.cuda.set_device(g)
        dsts.append(torch.empty(N, dtype=torch.uint8, device=f"cuda:{g}"))
    torch.cuda.set_device(0)
    for label, key, piece, streams in cases(srcs[0]):
        rates = [copy_rate(srcs[0][key][0], dsts[0], piece, streams) for _ in range(4)][1:]
        res["single"][label] = statistics.median(rates)
        print(f"GPU0 alone  {label:80s} {statistics.median(rates):6.2f} GiB/s", flush=True)
    if args.gpus > 1:
        for label, key, piece, streams in cases(srcs[0]):
            spans: dict[int, list] = {g: [] for g in range(args.gpus)}
            barrier = threading.Barrier(args.gpus)

            def go(g: int) -> None:
                torch.cuda.set_device(g)
                k = next(x for x in srcs[g] if x.split(" (")[0] == key.split(" (")[0])
                for _ in range(4):
                    barrier.wait()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    copy_rate(srcs[g][k][0], dsts[g], piece, streams)
                    spans[g].append((t0, time.perf_counter()))
            threads = [threading.Thread(target=go, args=(g,)) for g in range(args.gpus)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            agg = [args.gpus * N / GiB / (max(spans[g][i][1] for g in spans) - min(spans[g][i][0] for g in spans))
                   for i in range(1, 4)]
            res["together"][label] = statistics.median(agg)
            print(f"{args.gpus} GPUs      {label:80s} {statistics.median(agg):6.2f} GiB/s aggregate", flush=True)
    srcs.clear()  # the process exits next: mappings and registrations go with it
    for f in work.glob("f*"):
        f.unlink()
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
