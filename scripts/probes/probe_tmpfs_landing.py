#!/usr/bin/env python3
"""What landing bytes in a tmpfs file costs, per way of preparing its pages (issue 25: S3 staging's floor).

A ranged GET lands its bytes with the kernel's copy into the destination file's mapping (remote/direct.py):
the page faults, the page allocation and its zeroing are paid inside that copy unless the pages are made
first. This probe copies with the same kernel path (`preadv` from a tmpfs source already in memory, as a
socket's `recv` copies out of its buffers) into fresh tmpfs files, 16 MiB chunks taken off one queue by
N threads, and records the CPU seconds per GiB (every thread) and the rate for each preparation:

    fault          nothing: every 4 KiB page faulted in, allocated and zeroed inside the copy
    fallocate      posix_fallocate the chunk first (what the S3 staging did: ENOSPC instead of SIGBUS)
    fallocate+pop  then MADV_POPULATE_WRITE: the page tables filled in one call, no fault per page
    collapse       HugePager.prepare: a byte per 2 MiB block, then MADV_COLLAPSE (memory/hugepages.py)
    pwrite         the copy into a per-thread 1 MiB buffer, then pwrite (tmpfs skips zeroing whole pages)

    python scripts/probes/probe_tmpfs_landing.py --size 4GiB --threads 1,8,16 --reps 3 --out landing.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mxlaunch.plugin.host_pages import MADV_POPULATE_WRITE  # noqa: E402
from mxlaunch.memory.hugepages import FileMapping, HugePager, _libc  # noqa: E402

CHUNK = 16 << 20
FILE = 1 << 30
WAYS = ("fault", "fallocate", "fallocate+pop", "collapse", "pwrite")


def prepare(way: str, fd: int, mapping: FileMapping, off: int, n: int, pager: HugePager) -> None:
    if way in ("fallocate", "fallocate+pop"):
        os.posix_fallocate(fd, off, n)
    if way == "fallocate+pop" and _libc.madvise(mapping.addr + off, n, MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE failed")
    if way == "collapse" and not pager.prepare(mapping, fd, off, off + n):
        raise OSError(pager.reason or "the range was not collapsed")


def land(way: str, src_fd: int, dest: Path, total: int, threads: int) -> tuple[float, float]:
    """Fill `total` bytes of fresh files under `dest` the given way; returns (seconds, CPU seconds)."""
    files = []
    for k in range(total // FILE):
        fd = os.open(dest / f"f{k}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, FILE)
        files.append((fd, FileMapping(fd, FILE)))
    pager = HugePager(max_cpu_s_per_gib=1e9, probe_bytes=0, concurrent=threads)  # collapses every chunk, no verdict
    work: "queue.Queue[tuple[int, int]]" = queue.Queue()
    for k in range(len(files)):
        for off in range(0, FILE, CHUNK):
            work.put((k, off))

    def run() -> None:
        buf = bytearray(1 << 20)
        while True:
            try:
                k, off = work.get_nowait()
            except queue.Empty:
                return
            fd, mapping = files[k]
            prepare(way, fd, mapping, off, CHUNK, pager)
            if way == "pwrite":
                for at in range(off, off + CHUNK, len(buf)):
                    os.preadv(src_fd, [buf], at % FILE)
                    os.pwrite(fd, buf, at)
            else:
                os.preadv(src_fd, [mapping.view[off:off + CHUNK]], off)

    cpu0, t0 = time.process_time(), time.perf_counter()
    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for k, (fd, mapping) in enumerate(files):
        mapping.close()
        os.close(fd)
        os.unlink(dest / f"f{k}")
    return took, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4GiB", help="bytes landed per measurement (whole GiB)")
    ap.add_argument("--threads", default="1,8,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpus", default="", help="pin to these cores first (e.g. 8-15)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    total = int(args.size.removesuffix("GiB")) << 30
    if args.cpus:
        from bench_s3_stage import parse_cpus  # noqa: PLC0415 — the same "0-7,12" form

        os.sched_setaffinity(0, parse_cpus(args.cpus))
    shm = Path(tempfile.mkdtemp(prefix="mx-probe-landing-", dir="/dev/shm"))
    results: dict[str, dict] = {}
    try:
        src = shm / "source"
        with open(src, "wb") as f:
            for _ in range(FILE // CHUNK):
                f.write(os.urandom(CHUNK))
        src_fd = os.open(src, os.O_RDONLY)
        for threads in [int(t) for t in args.threads.split(",")]:
            seen: dict[str, list] = {w: [] for w in WAYS}
            for rep in range(args.reps):  # interleaved
                for way in WAYS:
                    try:
                        seen[way].append(land(way, src_fd, shm, total, threads))
                    except OSError as exc:
                        seen[way].append(str(exc))
                    last = seen[way][-1]
                    shown = last if isinstance(last, str) else f"{total / (1 << 30) / last[0]:.2f} GiB/s, {last[1] / (total / (1 << 30)):.3f} CPU s/GiB"
                    print(f"threads {threads} rep {rep} {way}: {shown}", flush=True)
            for way, runs in seen.items():
                ok = [r for r in runs if not isinstance(r, str)]
                results[f"{way} x{threads}"] = ({"gibps_median": round(statistics.median(total / (1 << 30) / s for s, _ in ok), 3),
                                                 "cpu_s_per_gib_median": round(statistics.median(c / (total / (1 << 30)) for _, c in ok), 3)}
                                                if ok else {"error": runs[0]})
        os.close(src_fd)
    finally:
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()
    doc = {"schema": 1, "date": dt.date.today().isoformat(), "machine": f"{os.cpu_count()} cores, kernel {platform.release()}",
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "bytes": total, "reps": args.reps,
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
