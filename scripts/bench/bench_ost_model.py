#!/usr/bin/env python3
"""Staging read schedules against a model of Lustre OSTs (mxlaunch/staging/ost_model.py): the same files,
the same model, four ways of reading them, on several real layouts. Each way's reader count is in the
JSON (readers_of says which). Real bytes move (tmpfs to tmpfs), each request's copy inside its modelled
transfer (--copy-after: after it, as before 2026-12-02); each request is held to its OSTs' service curve,
so the schedule is what decides the time. The JSON has each way's requests in flight over the OSTs per
0.1 s (in_flight_timeline: the ramp and the tail).

    python scripts/bench/bench_ost_model.py --out docs/bench-results/ost_model.json [--chart docs/bench-results/ost_model.png]

Ways of reading:
  mxlaunch        StageJob with the files' layouts: chunks cut at stripes, the next chunk to the OST with
                  the fewest requests in flight, an OST's last chunks in pieces (staging/schedule.py), with
                  the readers it picks from the layouts (16 per OST, at least --readers, at most 128;
                  readers_for_layouts)
  file-by-file    32 readers, each takes the next whole file and reads it in order, one request in flight
  dd-slices       servekit's: the files cut into 64 MiB slices, one `dd bs=1M` per slice, as many at once
                  as mxlaunch's readers
  prefetch        vLLM's --safetensors-load-strategy prefetch: one reader, file after file, 4 MiB reads

Layouts (the parsed `lfs getstripe` outputs of mxlaunch/staging/lustre_samples.py; a checkpoint's files start on
successive OSTs, as Lustre's allocator places them, over 8 OSTs):
  multi-stripe    4 stripes of 4 MiB per file (PLAIN_MULTI)
  few-osts        1 stripe per file (PLAIN_SINGLE): the checkpoint on 4 OSTs, two files each
  pfl             the PFL composite (PFL_PLAIN): 1 stripe to 4 MiB, 2 to 64 MiB, 4 after
  dom-overstriped the first MiB on the MDT (Data-on-MDT), the rest overstriped 2 stripes per OST on 4 OSTs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mxlaunch.staging.lustre import Component, Layout, parse_getstripe  # noqa: E402
from mxlaunch.staging.ost_model import MDT, OstCurve, OstModel  # noqa: E402
from mxlaunch.staging.reader import StageJob  # noqa: E402
from mxlaunch.staging.schedule import readers_for_layouts  # noqa: E402
from mxlaunch.staging.sources import CopyItem  # noqa: E402
from mxlaunch.staging.lustre_samples import PFL_PLAIN, PLAIN_MULTI, PLAIN_SINGLE  # noqa: E402

MiB = 1 << 20
OSTS = 8


def shifted(layout: Layout, by: int) -> Layout:
    """The same layout with its OSTs moved on by `by` (mod OSTS): the next file of the checkpoint."""
    return Layout([replace(c, osts=[(o + by) % OSTS for o in c.osts]) for c in layout.components])


def layouts_for(name: str, files: int) -> list[Layout]:
    if name == "multi-stripe":
        base = parse_getstripe(PLAIN_MULTI)
        return [shifted(base, i) for i in range(files)]
    if name == "few-osts":
        base = parse_getstripe(PLAIN_SINGLE)  # OST 3
        return [shifted(base, i % 4) for i in range(files)]
    if name == "pfl":
        base = parse_getstripe(PFL_PLAIN)
        return [shifted(base, i) for i in range(files)]
    if name == "dom-overstriped":
        return [Layout([Component(0, MiB, MiB, 0, []),
                        Component(MiB, 1 << 63, 4 * MiB, 8, [(i + k) % 4 for k in (0, 0, 1, 1, 2, 2, 3, 3)])])
                for i in range(files)]
    raise ValueError(name)


def copy_range(src: Path, dst_fd: int, offset: int, length: int) -> None:
    with open(src, "rb") as fh:
        data = os.pread(fh.fileno(), length, offset)
    os.pwrite(dst_fd, data, offset)


def sequential_readers(items: list[CopyItem], dest: Path, model: OstModel, *, workers: int,
                       units: list[tuple[int, int, int]], request: int) -> None:
    """`workers` threads over `units` (file index, start, length) in order; each reads its unit in
    `request`-sized reads, one in flight (a dd, a file-by-file reader, prefetch)."""
    fds = {}
    for i, item in enumerate(items):
        fds[i] = os.open(dest / item.rel, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(fds[i], item.size)
    work: "queue.Queue[tuple[int, int, int]]" = queue.Queue()
    for unit in units:
        work.put(unit)

    def run() -> None:
        while True:
            try:
                index, start, length = work.get_nowait()
            except queue.Empty:
                return
            pos = start
            while pos < start + length:
                n = min(request, start + length - pos)
                with model.transfer(index, pos, n):  # the copy inside the modelled transfer, as mxlaunch's
                    copy_range(items[index].src, fds[index], pos, n)
                pos += n

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds.values():
        os.close(fd)


def readers_of(way: str, layouts: list[Layout], readers: int, fixed: bool) -> int:
    """The readers a way runs with: mxlaunch's own choice when the user gives none (readers_for_layouts),
    the same for servekit's slices (it starts them all at once, so more is closer to it), --readers for
    the file-by-file readers (no use for more than the files), one for prefetch."""
    if way == "prefetch":
        return 1
    if way in ("mxlaunch", "dd-slices") and not fixed:
        return readers_for_layouts(readers, layouts)
    return readers


def run_way(way: str, items: list[CopyItem], layouts: list[Layout], dest: Path, curve: OstCurve, link: float,
            readers: int, copy_inside: bool = True) -> tuple[float, OstModel]:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    model = OstModel(layouts, curve, link, copy_inside=copy_inside)
    t0 = time.monotonic()
    if way == "mxlaunch":
        StageJob(items, dest, readers=readers, chunk_size=4 * MiB, layouts=layouts, ost_model=model,
                 use_o_direct=False, huge_pages=False).start().wait()
    elif way == "file-by-file":
        sequential_readers(items, dest, model, workers=readers, request=4 * MiB,
                           units=[(i, 0, it.size) for i, it in enumerate(items)])
    elif way == "dd-slices":
        slice_ = 64 * MiB
        units = [(i, s, min(slice_, it.size - s)) for i, it in enumerate(items) for s in range(0, it.size, slice_)]
        sequential_readers(items, dest, model, workers=readers, request=MiB, units=units)
    elif way == "prefetch":
        sequential_readers(items, dest, model, workers=1, request=4 * MiB,
                           units=[(i, 0, it.size) for i, it in enumerate(items)])
    else:
        raise ValueError(way)
    seconds = time.monotonic() - t0
    for item in items:  # every way must have made exact copies
        if (dest / item.rel).read_bytes() != item.src.read_bytes():
            raise SystemExit(f"{way}: {item.rel} differs")
    return seconds, model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--ost-mib-s", type=float, default=40.0, help="one OST's ceiling (the model is scaled down "
                    "so that this machine's copies are never the limit)")
    ap.add_argument("--n-half", type=float, default=2.0, help="requests in flight for half an OST's ceiling")
    ap.add_argument("--link-mib-s", type=float, default=400.0, help="the client's link, over all OSTs")
    ap.add_argument("--readers", type=int, default=32, help="the default reader count (mxlaunch's without Lustre)")
    ap.add_argument("--readers-fixed", action="store_true", help="run every way with --readers (mxlaunch's "
                    "--readers given), not the count mxlaunch picks from the layouts")
    ap.add_argument("--copy-after", action="store_true", help="copy each request's bytes after its modelled "
                    "transfer, not during it (the benchmark before 2026-12-02: this VM's copy time then counts "
                    "as OST idle time)")
    ap.add_argument("--layouts", default="multi-stripe,few-osts,pfl,dom-overstriped")
    ap.add_argument("--ways", default="mxlaunch,file-by-file,dd-slices,prefetch")
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/mx-ost-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chart", type=Path, default=None, help="per-OST utilisation over time (needs matplotlib)")
    args = ap.parse_args()
    curve, link = OstCurve(args.ost_mib_s * MiB, args.n_half), args.link_mib_s * MiB
    src = args.work / "src"
    shutil.rmtree(args.work, ignore_errors=True)
    src.mkdir(parents=True)
    items = []
    for i in range(args.files):
        path = src / f"model-{i:05d}.safetensors"
        path.write_bytes(os.urandom(args.file_mib * MiB))
        items.append(CopyItem(src=path, rel=path.name, size=args.file_mib * MiB))
    results: dict = {}
    timelines: dict = {}
    try:
        for name in args.layouts.split(","):
            layouts = layouts_for(name, args.files)
            probe = OstModel(layouts, curve, link)
            total = sum(it.size for it in items)
            ceiling = probe.ceiling_for([it.size for it in items])  # where the bytes are decides what is reachable
            results[name] = {"servers": sorted(probe.servers()), "ceiling_mib_s": round(ceiling / MiB, 1),
                             "every_server_at_its_ceiling_mib_s": round(probe.ceiling_bps() / MiB, 1), "ways": {}}
            for way in args.ways.split(","):
                readers = readers_of(way, layouts, args.readers, args.readers_fixed)
                seconds, model = run_way(way, items, layouts, args.work / "dst", curve, link, readers,
                                         copy_inside=not args.copy_after)
                report = model.report(seconds)
                rate = total / seconds
                results[name]["ways"][way] = {
                    "readers": readers,
                    "seconds": round(seconds, 3), "mib_s": round(rate / MiB, 1), "vs_ceiling": round(rate / ceiling, 3),
                    "busy_fraction_min": min(r["busy_fraction"] for srv, r in report.items() if srv != MDT),
                    "mean_in_flight_per_ost": round(sum(r["mean_in_flight"] for srv, r in report.items() if srv != MDT)
                                                    / max(1, sum(1 for srv in report if srv != MDT)), 2),
                    "in_flight_timeline": [round(sum(col), 1) for col in zip(*(r["depth_timeline"] for srv, r in
                                                                             report.items() if srv != MDT))],
                    "utilisation_mean": round(sum(r["utilisation"] for r in report.values()) / len(report), 3),
                    "per_server": {s: {k: v for k, v in r.items() if k not in ("timeline", "depth_timeline")}
                                   for s, r in report.items()}}
                timelines[(name, way)] = {s: r["timeline"] for s, r in report.items()}
                print(f"{name:16s} {way:13s} {readers:4d} readers {seconds:7.2f} s  {rate / MiB:7.1f} MiB/s  "
                      f"{rate / ceiling:5.2f}× ceiling  OSTs busy≥{results[name]['ways'][way]['busy_fraction_min']:.2f}",
                      flush=True)
            ways = results[name]["ways"]
            if "mxlaunch" in ways and "file-by-file" in ways:
                results[name]["mxlaunch_vs_file_by_file"] = round(ways["file-by-file"]["seconds"] / ways["mxlaunch"]["seconds"], 3)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    doc = {"schema": 1, "date": dt.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "command": " ".join(["python", *sys.argv]),
           "model": {"osts": OSTS, "ost_ceiling_mib_s": args.ost_mib_s, "n_half": args.n_half,
                     "link_mib_s": args.link_mib_s, "readers": args.readers, "readers_fixed": args.readers_fixed,
                     "copy": "after the modelled transfer" if args.copy_after else "during the modelled transfer"},
           "bytes": sum(it.size for it in items), "files": args.files, "layouts": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.chart:
        chart(timelines, args.chart, {(name, way): r["readers"] for name in results
                                      for way, r in results[name]["ways"].items()})
    return 0


def chart(timelines: dict, path: Path, readers: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no chart", file=sys.stderr)
        return
    pairs = [k for k in timelines if k[0] == "few-osts" and k[1] in ("mxlaunch", "file-by-file")] or list(timelines)[:2]
    fig, axes = plt.subplots(len(pairs), 1, figsize=(9, 3 * len(pairs)), sharex=True)
    for ax, key in zip(axes if len(pairs) > 1 else [axes], pairs):
        for server, line in sorted(timelines[key].items()):
            ax.plot([i * 0.1 for i in range(len(line))], line, label=server, linewidth=1)
        ax.set_title(f"{key[0]}: {key[1]} ({readers[key]} readers) — each OST's delivered share of its ceiling")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("utilisation")
        ax.legend(fontsize=7, ncol=4)
    axes[-1].set_xlabel("seconds") if len(pairs) > 1 else axes.set_xlabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
