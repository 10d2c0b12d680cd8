#!/usr/bin/env python3
"""A store-held zygote image restored the two ways (issue 42 item 3): checked in place and read by CRIU from the
store (before), against staged into /dev/shm by the stage's readers, checked as it lands, and restored from the
copy (warmstart/image_stage.py). One machine, one run, the modes interleaved per rep, the image's pages evicted
from the page cache before every restore (a new job on a node, or an image on a shared file system).

    MXLAUNCH_CRIU=$PWD/.criu4-kit/run.sh python scripts/bench/bench_image_stage.py --ballast-mib 2048 --reps 3 \
        --out docs/bench-results/image_stage_cpu_<date>.json

Needs CRIU 4+ and CAP_CHECKPOINT_RESTORE (root here). The zygote is a plain Python whose preload holds
`--ballast-mib` of random bytes (an engine's imported state stands in: the image's size is what matters); the
time is restore_zygote's, from the call to the restored zygote's socket: what a launch waits for.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from mxlaunch.warmstart import criu, zygote, zygote_image  # noqa: E402
from mxlaunch.warmstart.image_sums import image_files  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from page_cache import evict  # noqa: E402

BALLAST = '''
import os
BALLAST = os.urandom(int(os.environ["MXZ_BALLAST_MIB"]) << 20)  # the zygote's imported state, in the image
'''
MODES = ("in-place", "staged")


def evict_image(folder: Path) -> int:
    """Drop the page cache of the image's files; the bytes evicted."""
    return evict(image_files(folder))


def wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        try:
            os.waitpid(pid, os.WNOHANG)  # a restored zygote may be this process's child (CRIU's subreaper)
        except ChildProcessError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} still there after {timeout:.0f} s")
        time.sleep(0.05)


def stop(key: str, pid: int) -> None:
    zygote.socket_path(key).unlink(missing_ok=True)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    wait_gone(pid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ballast-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    binary, why = criu.why_not()
    if binary is None:
        sys.exit(f"bench_image_stage: no usable CRIU: {why}")
    root = Path(tempfile.mkdtemp(prefix="mxb", dir="/tmp"))  # a Unix socket's path has 107 bytes at most
    run = Path(tempfile.mkdtemp(prefix="mxb-run-", dir="/dev/shm"))  # the launch's run folder (0700)
    zygote.SHM_ROOT = root / "shm"
    (root / "shm").mkdir()
    (root / "mxz_ballast.py").write_text(BALLAST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "MXZ_BALLAST_MIB": str(args.ballast_mib)}
    entry = zygote.ZygoteEntry(sys.executable, "module", "json.tool", (), ("mxz_ballast",))
    store = root / "store"
    key = zygote.zygote_key(entry, "1", env, str(root), salt=zygote_image.key_salt(store))
    pid = zygote.start_zygote(key, entry, env, str(root), root / "logs", for_image=True)
    if pid is None:
        sys.exit("bench_image_stage: the zygote did not start (see its log)")
    events: list[tuple[str, dict]] = []
    maker = zygote_image.ImageMaker(binary, pid, key, store, root / "logs" / "zygote.log", root / "criu",
                                    lambda e, **f: events.append((e, f)))
    maker.start()
    maker.join(600)
    runs: list[dict] = []
    try:
        if not events or events[0][1].get("status") != "published":
            sys.exit(f"bench_image_stage: no image: {events}")
        image = zygote_image.image_dir(store, key)
        image_bytes = sum(p.stat().st_size for p in image_files(image))
        print(f"image: {image_bytes / 2**30:.2f} GiB in {len(image_files(image))} files", flush=True)
        for rep in range(args.reps):
            for mode in MODES:
                stop(key, pid)
                evicted = evict_image(image)
                t0 = time.monotonic()
                got = zygote_image.restore_zygote(binary, store, key, root / f"logs-{rep}-{mode}" / "zygote.log",
                                                  root / f"criu-{rep}-{mode}",
                                                  stage_root=run if mode == "staged" else None)
                seconds = time.monotonic() - t0
                pid = got["pid"]
                runs.append({"rep": rep, "mode": mode, "restore_s": round(seconds, 3), "evicted_bytes": evicted,
                             **{k: got[k] for k in ("image_stage_s", "image_gib_per_s", "o_direct") if k in got}})
                print(f"rep {rep} {mode}: {seconds:.3f} s {got.get('image_stage_s', '')}", flush=True)
    finally:
        stop(key, pid)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    median = {m: statistics.median(r["restore_s"] for r in runs if r["mode"] == m) for m in MODES}
    result = {"benchmark": "image_stage", "date": dt.date.today().isoformat(), "machine": platform.node(),
              "cpus": os.cpu_count(), "command": " ".join(["python", *sys.argv]), "image_bytes": image_bytes,
              "ballast_mib": args.ballast_mib, "runs": runs, "median_restore_s": median,
              "staged_over_in_place": round(median["staged"] / median["in-place"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("image_bytes", "median_restore_s", "staged_over_in_place")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
