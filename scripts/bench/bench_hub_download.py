#!/usr/bin/env python3
"""A hub model's download, four ways against one hub-compatible server (tests/helpers/hub_server.py) in the
same run: the server's own ceiling (parallel ranged GETs read and dropped), one plain GET per file written
to disk (a single stream), huggingface_hub's snapshot_download, and mxlaunch's downloader (remote/fetch.py:
parallel ranged GETs written in place, hashes checked). Each into an empty cache, `--reps` times; medians.

    python scripts/bench/bench_hub_download.py --size 1GiB --out docs/bench-results/hub_download.json

The server is Python's ThreadingHTTPServer on this machine, so the ceiling is its, not a hub's: the
ratios say how close each client gets to what the server can give, not what huggingface.co does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mxlaunch.remote import hub  # noqa: E402
from mxlaunch.remote.fetch import ensure_model  # noqa: E402
from mxlaunch.store.core import Store  # noqa: E402
from tests.helpers.hub_server import HubServer  # noqa: E402

REPO_ID = "bench/model"
HF_SNAPSHOT = "from huggingface_hub import snapshot_download as s; import sys; s(sys.argv[1], cache_dir=sys.argv[2])"


def ceiling(url: str, rev: hub.HubRevision, workers: int, chunk: int) -> float:
    """Parallel ranged GETs of every file, bytes dropped: what the server gives."""
    tasks = [(f, start) for f in rev.files for start in range(0, max(f.size, 1), chunk)]
    lock = threading.Lock()

    def work(client: httpx.Client) -> None:
        while True:
            with lock:
                if not tasks:
                    return
                f, start = tasks.pop()
            end = min(f.size, start + chunk) - 1
            with client.stream("GET", rev.url(f), headers={"range": f"bytes={start}-{end}"}) as resp:
                for _ in resp.iter_bytes(1 << 20):
                    pass

    t0 = time.monotonic()
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=workers)) as client:
        threads = [threading.Thread(target=work, args=(client,)) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return time.monotonic() - t0


def single_stream(rev: hub.HubRevision, dest: Path) -> float:
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as client:
        for f in rev.files:
            out = dest / f.path
            out.parent.mkdir(parents=True, exist_ok=True)
            with client.stream("GET", rev.url(f)) as resp, open(out, "wb") as fh:
                for data in resp.iter_bytes(1 << 20):
                    fh.write(data)
    return time.monotonic() - t0


def hf_hub(url: str, cache: Path) -> float:
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", HF_SNAPSHOT, REPO_ID, str(cache)], env=env, check=True, capture_output=True)
    return time.monotonic() - t0


def mxlaunch(url: str, cache: Path, store: Path, workers: int) -> float:
    t0 = time.monotonic()
    ensure_model(REPO_ID, None, Store(store), lambda *a, **k: None, cache=cache, environ={"HF_ENDPOINT": url},
                 workers=workers)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="scripts/kits/make_tiny_model.py --size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mx-hub-bench-"))
    try:
        model = work / "model"
        subprocess.run([sys.executable, str(REPO / "scripts" / "kits" / "make_tiny_model.py"), "--out", str(model),
                        "--size", args.size], check=True, capture_output=True)
        with HubServer({REPO_ID: model}) as server:
            with httpx.Client() as client:
                rev = hub.fetch_revision(client, server.url, REPO_ID, None)
            total = rev.total_bytes
            runs: dict[str, list[float]] = {"ceiling": [], "single_stream": [], "huggingface_hub": [], "mxlaunch": []}
            for rep in range(args.reps):
                runs["ceiling"].append(ceiling(server.url, rev, args.workers, 16 << 20))
                for name in ("single_stream", "huggingface_hub", "mxlaunch"):
                    dest = work / f"{name}-{rep}"
                    seconds = {"single_stream": lambda: single_stream(rev, dest),
                               "huggingface_hub": lambda: hf_hub(server.url, dest),
                               "mxlaunch": lambda: mxlaunch(server.url, dest, work / f"store-{rep}", args.workers)}[name]()
                    runs[name].append(seconds)
                    shutil.rmtree(dest, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        gib = total / (1 << 30)
        result = {
            "schema": 1, "date": dt.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "bytes": total, "files": len(rev.files),
            "workers": args.workers, "seconds": runs,
            "gib_per_s": {k: round(gib / v, 3) for k, v in med.items()},
            "mxlaunch_vs_ceiling": round(med["ceiling"] / med["mxlaunch"], 3),
            "mxlaunch_vs_huggingface_hub": round(med["huggingface_hub"] / med["mxlaunch"], 3),
            "mxlaunch_vs_single_stream": round(med["single_stream"] / med["mxlaunch"], 3),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("gib_per_s", "mxlaunch_vs_ceiling", "mxlaunch_vs_huggingface_hub",
                                             "mxlaunch_vs_single_stream")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
