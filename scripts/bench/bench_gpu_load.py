"""GPU weight path benchmark (issue 11): staged snapshot → CUDA tensors, and capture CUDA → /dev/shm.

One run, one process, same bytes: a snapshot of one Llama-70B TP4 rank (vLLM's fused layout: qkv_proj,
o_proj, gate_up_proj, down_proj, two norms per layer; 28 layers = 12.14 GiB bf16, 171 tensors) is
captured from CUDA tensors by `capture_tensors`, copied to local disk, staged back into /dev/shm by
`mxlaunch stage` (2 MiB pages), and restored into preallocated CUDA tensors by every method; after each
load the bytes are checked on the GPU (`torch.equal` per tensor). Ceilings (one pinned buffer → GPU and
back) are measured in the same run. Medians of `--reps`.

    python scripts/bench/bench_gpu_load.py --out gpu_load.json [--layers 28] [--reps 3] [--peers]

Needs a CUDA GPU and torch; instanttensor / fastsafetensors are measured when importable.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mxlaunch.plugin import gpu_restore  # noqa: E402
from mxlaunch.plugin.loader import capture_tensors, restore_tensors  # noqa: E402
from gpu_shapes import rank_tensors  # noqa: E402  (shared with bench_gpu_two_ranks.py: no import circle)

GiB = 1 << 30


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def exact(dests: dict[str, torch.Tensor], gold: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(dests[n], gold[n]) for n in gold)


def zero(dests: dict[str, torch.Tensor]) -> None:
    for t in dests.values():
        t.zero_()
    torch.cuda.synchronize()


def files_of(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.safetensors"))


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def with_env(env: dict[str, str], fn):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_method(name: str, load, dests, gold, nbytes: int, reps: int, res: dict, extra=None) -> None:
    times, ok, info = [], True, None
    for _ in range(reps):
        zero(dests)
        torch.cuda.synchronize()
        start = time.perf_counter()
        info = load()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        ok = ok and exact(dests, gold)
    med = statistics.median(times)
    row = {"gibps": nbytes / GiB / med, "seconds": times, "exact": ok}
    if isinstance(info, dict):
        row["info"] = info
    if extra:
        row.update(extra)
    res["methods"][name] = row
    print(f"{name:40s} {row['gibps']:7.2f} GiB/s  exact={ok}  {[round(x, 3) for x in times]}", flush=True)


def mx_load(files: list[str], dests: dict[str, torch.Tensor], mode: str):
    def load():
        r = with_env({"MXLAUNCH_GPU_COPY": mode},
                     lambda: restore_tensors(list(dests.items()), files, wait_timeout_s=5))
        return r.gpu or {"copy_bytes": r.copy_bytes}
    return load


def early_registration(files: list[str], dests, gold, nbytes: int, reps: int, res: dict) -> None:
    """The default path as the adapters run it: prepare() at the start of the load step registers the
    staged files while the model is built; the clock then times the weight phase alone. The registration
    time and the unpinning after it are reported beside it, and a run with no time between prepare()
    and the restore shows the worst case (the restore takes what is registered, the ring the rest)."""
    for name, build_s in (("mxlaunch default, files registered during model build", None),
                          ("mxlaunch default, restore right after prepare (no model build)", 0.0)):
        times, regs, unpins, info, ok = [], [], [], None, True
        for _ in range(reps):
            zero(dests)
            t0 = time.perf_counter()
            gpu_restore.prepare(torch.cuda.current_device(), files, timeout_s=10)
            if build_s is None:
                regs.append(gpu_restore._registrar.wait())
                gpu_restore._early._thread.join()
            torch.cuda.synchronize()
            start = time.perf_counter()
            r = restore_tensors(list(dests.items()), files, wait_timeout_s=5)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            unpins.append(gpu_restore.release_pending())
            res.setdefault("prepare_to_done", []).append(time.perf_counter() - t0)
            info = r.gpu
            ok = ok and exact(dests, gold)
        row = {"gibps": nbytes / GiB / statistics.median(times), "seconds": times, "exact": ok, "info": info,
               "unpin_seconds_after": unpins}
        if regs:
            row["early_register_seconds"] = regs
            row["early_register_gibps"] = nbytes / GiB / statistics.median(regs)
        res["methods"][name] = row
        print(f"{name:40s} {row['gibps']:7.2f} GiB/s exact={ok} registration {regs} unpin {unpins}", flush=True)


def mx_early(files: list[str], dests: dict[str, torch.Tensor]):
    """The ring pinned while 'the engine builds the model' (before the clock starts), as the adapters do."""
    def load():
        with_env({"MXLAUNCH_GPU_COPY": "ring"}, lambda: gpu_restore.prepare(torch.cuda.current_device()))
        gpu_restore._early._thread.join()  # the model build would take longer than the pinning
        torch.cuda.synchronize()
        return None
    return load


SWEEP = [
    {"MXLAUNCH_GPU_COPY": "register", "MXLAUNCH_GPU_REGISTRARS": "1", "MXLAUNCH_GPU_REGISTER_MIB": "128"},
    {"MXLAUNCH_GPU_COPY": "register", "MXLAUNCH_GPU_REGISTRARS": "1", "MXLAUNCH_GPU_REGISTER_MIB": "128",
     "MXLAUNCH_GPU_POPULATE": "1"},
    {"MXLAUNCH_GPU_COPY": "register", "MXLAUNCH_GPU_REGISTRARS": "8", "MXLAUNCH_GPU_REGISTER_MIB": "1024",
     "MXLAUNCH_GPU_POPULATE": "1"},
    {"MXLAUNCH_GPU_COPY": "register", "MXLAUNCH_GPU_REGISTRARS": "12", "MXLAUNCH_GPU_REGISTER_MIB": "128",
     "MXLAUNCH_GPU_POPULATE": "1"},
    {"MXLAUNCH_GPU_COPY": "ring", "MXLAUNCH_GPU_READERS": "16", "MXLAUNCH_GPU_CHUNK_MIB": "16"},
    {"MXLAUNCH_GPU_COPY": "auto", "MXLAUNCH_GPU_REGISTRARS": "4", "MXLAUNCH_GPU_REGISTER_MIB": "256",
     "MXLAUNCH_GPU_READERS": "12", "MXLAUNCH_GPU_CHUNK_MIB": "16", "MXLAUNCH_GPU_POPULATE": "1"},
]


def sweep(files: list[str], dests, gold, nbytes: int, reps: int, res: dict) -> None:
    """Each setting: the restore with its ring pinned beforehand (as during model build) and from cold."""
    res["sweep"] = []
    for env in SWEEP:
        row = {"env": env}
        for early in (True, False):
            if not early and env["MXLAUNCH_GPU_COPY"] == "register":
                continue
            times, info = [], None
            for _ in range(reps):
                zero(dests)

                def go():
                    if early:
                        gpu_restore.prepare(torch.cuda.current_device())
                        if gpu_restore._early is not None:
                            gpu_restore._early._thread.join()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    r = restore_tensors(list(dests.items()), files, wait_timeout_s=5)
                    torch.cuda.synchronize()
                    return time.perf_counter() - start, r.gpu
                t, info = with_env(env, go)
                times.append(t)
            key = "early" if early else "cold"
            row[key] = {"gibps": nbytes / GiB / statistics.median(times), "seconds": times,
                        "exact": exact(dests, gold), "info": info}
            print(f"{json.dumps(env)} {key}: {row[key]['gibps']:.2f} GiB/s exact={row[key]['exact']}", flush=True)
        res["sweep"].append(row)


def prepared_capture(named, work: Path, nbytes: int, reps: int, res: dict) -> None:
    """The capture as the adapters run it now: PreparedCapture.start() at the top of the load step lays the
    parts out in tmpfs and page-locks them while the engine loads; the clock then times capture_tensors
    alone (the DMA into the parts and the renames). The preparation's own time, the release after it,
    and a run with no loading between start and capture (the worst case, preparation in the clock)."""
    from mxlaunch.plugin import capture_prepare
    from mxlaunch.plugin.capture_prepare import PreparedCapture

    for name, overlap in (("capture_prepared", True), ("capture_prepared_worst", False)):
        times, preps, releases, info = [], [], [], None
        for _ in range(reps):
            out = work / "capture-prep"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            prep = PreparedCapture.start(named, out)
            if prep is None:
                res[name] = {"error": "not eligible"}
                return
            if overlap:
                prep._thread.join()  # the engine's loading takes longer than this
                preps.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            r = capture_tensors(named, out, prepared=prep)
            times.append(time.perf_counter() - start)
            releases.append(capture_prepare.release_pending())
            info = r.prepared
            if r.prepared is None:
                res[name] = {"error": "the prepared parts were not used"}
                return
        check = restore_check(named, out)
        res[name] = {"gibps": nbytes / GiB / statistics.median(times), "seconds": times, "info": info,
                     "prepare_seconds": preps, "release_seconds_after": releases, "exact": check}
        res[name]["x_d2h"] = res[name]["gibps"] / res["ceiling_d2h"]
        print(f"{name}: {res[name]['gibps']:.2f} GiB/s ({res[name]['x_d2h']:.2f}x D2H) {[round(x, 3) for x in times]} prepare {preps} "
              f"release {releases} exact={check}", flush=True)
        shutil.rmtree(work / "capture-prep", ignore_errors=True)


def restore_check(named, folder: Path) -> bool:
    """The captured files read back with safetensors equal the source tensors."""
    from safetensors import safe_open

    gold = dict(named)
    seen = set()
    for path in files_of(folder):
        with safe_open(path, framework="pt", device="cuda") as f:
            for key in f.keys():
                if not torch.equal(f.get_tensor(key), gold[key]):
                    return False
                seen.add(key)
    return seen == set(gold)


def registered_file_ceiling(files: list[str], res: dict, reps: int) -> None:
    """One copy of the largest staged file's bytes from its registered (2 MiB page) mapping into one GPU
    buffer, beside the pinned-buffer ceiling: what the DMA from a staged file itself can reach."""
    from mxlaunch.plugin.early_register import register_file

    path = max(files, key=lambda f: os.path.getsize(f))
    reg = register_file(path, torch.cuda.current_device(), span=1 << 40)
    src = None
    try:
        src = torch.frombuffer(reg.mapping.view, dtype=torch.uint8)
        dev = torch.empty(reg.size, dtype=torch.uint8, device="cuda")
        rates = [reg.size / GiB / sync_time(lambda: dev.copy_(src, non_blocking=True)) for _ in range(reps + 1)][1:]
    finally:
        src = dev = None  # the tensor views go before the mapping
        reg.release()
    res["ceiling_registered_file"] = {"gibps": statistics.median(rates), "all": rates, "bytes": reg.size}
    print(f"registered staged file -> GPU, one copy: {statistics.median(rates):.2f} GiB/s {rates}", flush=True)


def peers(staged_files: list[str], dests, gold, nbytes: int, R: int, res: dict, quick: bool = False) -> None:
    """instanttensor (all files), and unless quick fastsafetensors and safetensors' safe_open, on the same files."""
    try:
        import instanttensor

        def it_load():
            with instanttensor.safe_open(staged_files, framework="pt", device=torch.cuda.current_device(),
                                         copy=False) as f:
                for name, tensor in f.tensors():
                    dests[name].copy_(tensor)
        run_method("instanttensor 0.2.2 (all files)", it_load, dests, gold, nbytes, R, res)
    except ImportError as exc:
        res["methods"]["instanttensor"] = {"error": str(exc)}
    if quick:
        return
    try:
        from fastsafetensors import fastsafe_open

        def fst_load():
            with fastsafe_open(staged_files, device="cuda:0", nogds=True) as f:
                for name in f.keys():
                    dests[name].copy_(f.get_tensor(name))
        run_method("fastsafetensors (nogds)", fst_load, dests, gold, nbytes, 1, res)
    except ImportError as exc:
        res["methods"]["fastsafetensors"] = {"error": str(exc)}
    from safetensors import safe_open

    def st_load():
        for path in staged_files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    dests[name].copy_(f.get_tensor(name))
    run_method("safetensors safe_open per tensor", st_load, dests, gold, nbytes, 1, res)


def finish(res: dict, args, work: Path, disk: Path) -> None:
    """Ratios to the ceiling, peak RSS, the JSON; the work folders removed."""
    ceiling = res["ceiling_h2d"]
    for row in res["methods"].values():
        if "gibps" in row:
            row["x_ceiling"] = row["gibps"] / ceiling
    res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "methods"}, indent=1))



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="gpu_load.json")
    ap.add_argument("--work", default="/dev/shm/mx-bench")
    ap.add_argument("--disk", default="/tmp/mx-bench-disk")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time GPU-copy settings on the staged files, then stop")
    ap.add_argument("--quick", action="store_true",
                    help="only the ceilings, the captures, the default restore and instanttensor (--peers)")
    ap.add_argument("--ranks", type=int, default=0,
                    help="N processes, one per GPU, each restoring its own Llama-70B TP-N rank at once "
                         "(bench_gpu_two_ranks.py; --layers 80 for whole ranks)")
    ap.add_argument("--numa", choices=("default", "local", "both"), default="default", help="with --ranks")
    args = ap.parse_args()
    if args.ranks:
        import bench_gpu_two_ranks

        bench_gpu_two_ranks.run(args.ranks, args.layers, args.numa, "0", args.out)
        return
    work, disk = Path(args.work), Path(args.disk)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict = {"machine": torch.cuda.get_device_name(0), "cpus": os.cpu_count(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "methods": {}}
    named = rank_tensors(args.layers)
    gold = dict(named)
    nbytes = sum(t.numel() * t.element_size() for t in gold.values())
    res.update(tensors=len(named), gib=nbytes / GiB)
    print(f"rank: {len(named)} tensors, {nbytes / GiB:.2f} GiB", flush=True)

    # ceilings: one pinned buffer (allocation timed) <-> one GPU buffer
    n = 4 * GiB
    t = time.perf_counter()
    pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    res["pin_alloc_gibps"] = n / GiB / (time.perf_counter() - t)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = [n / GiB / sync_time(lambda: dev.copy_(pin, non_blocking=True)) for _ in range(args.reps + 1)][1:]
    d2h = [n / GiB / sync_time(lambda: pin.copy_(dev, non_blocking=True)) for _ in range(args.reps + 1)][1:]
    res["ceiling_h2d"], res["ceiling_d2h"] = statistics.median(h2d), statistics.median(d2h)
    res["ceiling_h2d_all"], res["ceiling_d2h_all"] = h2d, d2h
    pin = dev = None  # free both before the rank's tensors need the room
    print(f"ceiling H2D {res['ceiling_h2d']:.2f}  D2H {res['ceiling_d2h']:.2f} GiB/s", flush=True)

    # capture: CUDA tensors -> /dev/shm, pinned path (median) and the old pageable path (once)
    cap = work / "capture"
    caps = []
    for _ in range(args.reps):
        shutil.rmtree(cap, ignore_errors=True)
        r = capture_tensors(named, cap)
        caps.append(r.seconds)
    res["capture_pinned"] = {"gibps": nbytes / GiB / statistics.median(caps), "seconds": caps}
    print(f"capture writers {res['capture_pinned']['gibps']:.2f} GiB/s {[round(x, 3) for x in caps]}", flush=True)
    prepared_capture(named, work, nbytes, args.reps, res)
    if args.sweep:
        for env in ({"MXLAUNCH_CAPTURE_WRITERS": "16"}, {"MXLAUNCH_CAPTURE_HUGE": "0"},
                    {"MXLAUNCH_CAPTURE_HUGE": "0", "MXLAUNCH_CAPTURE_WRITERS": "16"}):
            shutil.rmtree(work / "capture-x", ignore_errors=True)
            r = with_env(env, lambda: capture_tensors(named, work / "capture-x"))
            res.setdefault("capture_sweep", []).append({"env": env, "gibps": nbytes / GiB / r.seconds})
            print(f"capture {env}: {nbytes / GiB / r.seconds:.2f} GiB/s", flush=True)
        shutil.rmtree(work / "capture-x", ignore_errors=True)
        res["capture_pageable"] = {"gibps": 0.0, "seconds": [0.0]}
    elif args.quick:
        res["capture_pageable"] = {"gibps": 0.0, "seconds": [0.0], "skipped": "--quick"}
    else:
        shutil.rmtree(work / "capture-old", ignore_errors=True)
        r = with_env({"MXLAUNCH_GPU_COPY": "pageable"}, lambda: capture_tensors(named, work / "capture-old"))
        res["capture_pageable"] = {"gibps": nbytes / GiB / r.seconds, "seconds": [r.seconds]}
        shutil.rmtree(work / "capture-old")
    res["capture_ratio_to_d2h"] = res["capture_pinned"]["gibps"] / res["ceiling_d2h"]
    print(f"capture pinned {res['capture_pinned']['gibps']:.2f} GiB/s ({res['capture_ratio_to_d2h']:.2f}x D2H), "
          f"pageable {res['capture_pageable']['gibps']:.2f}", flush=True)

    # the snapshot on local disk, then staged back into /dev/shm by `mxlaunch stage` (2 MiB pages)
    shutil.copytree(cap, disk)
    staged = work / "staged"
    res["drop_caches"] = drop_caches()
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mxlaunch.cli", "stage", str(disk), "--dest", str(staged), "--json"],
                       cwd=ROOT, capture_output=True, text=True)
    stage_s = time.perf_counter() - t
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:], flush=True)
        raise SystemExit("mxlaunch stage failed")
    try:
        res["stage"] = json.loads(p.stdout)
    except json.JSONDecodeError:
        res["stage"] = {"wall_seconds": stage_s}
    res["stage_wall_gibps"] = nbytes / GiB / stage_s
    staged_files = files_of(staged) or files_of(next(staged.rglob("*.safetensors")).parent)
    cap_files = files_of(cap)
    print(f"staged with mxlaunch stage: {res['stage_wall_gibps']:.2f} GiB/s (wall, from disk)", flush=True)

    dests = {k: torch.empty_like(v) for k, v in gold.items()}
    R = args.reps
    if args.sweep:
        sweep(staged_files, dests, gold, nbytes, R, res)
        Path(args.out).write_text(json.dumps(res, indent=1))
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        return
    registered_file_ceiling(staged_files, res, R)
    early_registration(staged_files, dests, gold, nbytes, R, res)
    if args.quick:
        if args.peers:
            peers(staged_files, dests, gold, nbytes, R, res, quick=True)
        finish(res, args, work, disk)
        return
    run_method("mxlaunch ring, pinned in the clock", mx_load(staged_files, dests, "ring"), dests, gold, nbytes, R, res)
    run_method("mxlaunch hybrid (registrar in the clock + ring)", mx_load(staged_files, dests, "hybrid"), dests, gold,
               nbytes, R, res)
    run_method("mxlaunch ring on the capture's files (4 KiB pages)", mx_load(cap_files, dests, "ring"), dests, gold,
               nbytes, R, res)
    early_times = []
    for _ in range(R):
        mx_early(staged_files, dests)()
        zero(dests)
        start = time.perf_counter()
        r = with_env({"MXLAUNCH_GPU_COPY": "ring"},
                     lambda: restore_tensors(list(dests.items()), staged_files, wait_timeout_s=5))
        torch.cuda.synchronize()
        early_times.append(time.perf_counter() - start)
    res["methods"]["mxlaunch ring, pinned during model build"] = {
        "gibps": nbytes / GiB / statistics.median(early_times), "seconds": early_times, "exact": exact(dests, gold),
        "info": r.gpu}
    print(f"{'mxlaunch ring, pinned during model build':40s} {nbytes / GiB / statistics.median(early_times):7.2f} GiB/s",
          flush=True)
    run_method("mxlaunch pageable (the old path)", mx_load(staged_files, dests, "pageable"), dests, gold, nbytes, 1, res)

    if args.peers:
        peers(staged_files, dests, gold, nbytes, R, res)

    # straight from local disk (page cache dropped): O_DIRECT reads into the pinned ring
    shutil.rmtree(staged, ignore_errors=True)
    disk_times = []
    for _ in range(2):
        res["drop_caches"] = drop_caches() and res["drop_caches"]
        zero(dests)
        start = time.perf_counter()
        r = restore_tensors(list(dests.items()), files_of(disk), wait_timeout_s=5)
        torch.cuda.synchronize()
        disk_times.append(time.perf_counter() - start)
    res["methods"]["mxlaunch from local disk (O_DIRECT ring)"] = {
        "gibps": nbytes / GiB / statistics.median(disk_times), "seconds": disk_times, "exact": exact(dests, gold),
        "info": r.gpu}
    print(f"{'mxlaunch from local disk':40s} {nbytes / GiB / statistics.median(disk_times):7.2f} GiB/s", flush=True)

    finish(res, args, work, disk)

if __name__ == "__main__":
    main()
