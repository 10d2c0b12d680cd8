#!/usr/bin/env python3
"""When can CRIU start? A lean snapshot's image and its weights, staged out of one store (issue 42).

A lean restore needs all of its image before CRIU can run, and the weights only once the restored engine
refills. On the H200's wiped node (session 23) the two were staged side by side from one disk and CRIU waited
5.7 s for a 2.7 GB image that alone stages in ~1.9 s; the launcher now copies the image first, then starts the
weights' stage (launch/run.py, `EngineSnapshots.stage_image_ahead`). This measures the two orders with the real
stage code (warmstart/image_stage.stage_image, staging/reader.StageJob), page cache evicted before every rep:

    image_ready_s   when CRIU could start (the image checked in /dev/shm)
    all_ready_s     when the weights are in /dev/shm too (the refill can finish)

    python scripts/bench/bench_image_first.py --image-mib 1024 --weights-mib 3072 --reps 3 \
        --out docs/bench-results/image_first_cpu_<date>.json

CRIU itself is not run here (its restore then overlaps the weights' stage in the image-first order; on the H200
it took 1.5-2.6 s); the files are random bytes on the machine's disk (TMPDIR), the copies go to /dev/shm.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from mxlaunch.stage import default_per_file, default_readers  # noqa: E402
from mxlaunch.staging.reader import StageJob  # noqa: E402
from mxlaunch.staging.sources import CopyItem  # noqa: E402
from mxlaunch.warmstart.image_stage import remove_copy, stage_image  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from page_cache import evict  # noqa: E402
from mxlaunch.warmstart.image_sums import write_sums  # noqa: E402

MODES = ("side-by-side", "image-first")
CHUNK = 64 << 20


def random_file(path: Path, mib: int) -> None:
    with open(path, "wb") as f:
        for _ in range(0, mib, 64):
            f.write(os.urandom(min(64, mib) << 20))
        f.flush()
        os.fsync(f.fileno())


def weights_job(weights: list[Path], dest: Path) -> StageJob:
    readers = default_readers()
    items = [CopyItem(src=p, rel=p.name, size=p.stat().st_size) for p in weights]
    return StageJob(items, dest, readers=readers, per_file=default_per_file(readers))


def one(mode: str, image: Path, weights: list[Path], shm: Path) -> dict:
    """One restore's staging in `mode`; the seconds from the start to the image's and to everything's landing."""
    dest = Path(tempfile.mkdtemp(prefix="weights-", dir=shm))
    t0 = time.monotonic()
    job = weights_job(weights, dest)
    image_at: dict[str, float] = {}
    copy = None
    try:
        if mode == "side-by-side":  # session 23's order: the weights' stage first, the image copied beside it
            job.start()
            copy, staged = stage_image(image, shm)
            image_at["s"] = time.monotonic() - t0
        else:  # the image first, then the weights (CRIU would restore now, while they land)
            copy, staged = stage_image(image, shm)
            image_at["s"] = time.monotonic() - t0
            job.start()
        job.wait()
        all_s = time.monotonic() - t0
    finally:
        remove_copy(copy)
        shutil.rmtree(dest, ignore_errors=True)
    return {"mode": mode, "image_ready_s": round(image_at["s"], 3), "all_ready_s": round(all_s, 3),
            "image_stage_s": staged["image_stage_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image-mib", type=int, default=1024)
    ap.add_argument("--weights-mib", type=int, default=3072)
    ap.add_argument("--image-files", type=int, default=8, help="a CRIU image is a few large pages-*.img and small files")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mxb-first-"))
    shm = Path(tempfile.mkdtemp(prefix="mxb-first-", dir="/dev/shm"))
    runs: list[dict] = []
    try:
        image = root / "image"
        image.mkdir(mode=0o700)
        per = max(1, args.image_mib // args.image_files)
        for i in range(args.image_files):
            random_file(image / f"pages-{i + 1}.img", per)
        write_sums(image)
        weights = []
        for i in range(max(1, args.weights_mib // 1024)):
            weights.append(root / f"model-{i:05d}.safetensors")
            random_file(weights[-1], min(1024, args.weights_mib - 1024 * i))
        files = [p for p in image.iterdir() if p.name.endswith(".img")] + weights
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else tuple(reversed(MODES)):  # the machine drifts: alternate
                evicted = evict(files)
                got = one(mode, image, weights, shm)
                runs.append({"rep": rep, "evicted_bytes": evicted, **got})
                print(f"rep {rep} {mode}: image {got['image_ready_s']:.3f} s, all {got['all_ready_s']:.3f} s", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    median = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m) for k in ("image_ready_s", "all_ready_s")}
              for m in MODES}
    result = {"benchmark": "image_first", "date": dt.date.today().isoformat(), "machine": platform.node(),
              "cpus": os.cpu_count(), "command": " ".join(["python", *sys.argv]), "image_mib": args.image_mib,
              "weights_mib": args.weights_mib, "runs": runs, "median": median,
              "image_ready_first_over_side_by_side": round(median["image-first"]["image_ready_s"]
                                                           / median["side-by-side"]["image_ready_s"], 3),
              "all_ready_first_over_side_by_side": round(median["image-first"]["all_ready_s"]
                                                         / median["side-by-side"]["all_ready_s"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median", "image_ready_first_over_side_by_side",
                                             "all_ready_first_over_side_by_side")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
