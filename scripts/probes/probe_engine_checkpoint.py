#!/usr/bin/env python3
"""Probe an engine snapshot's two halves on this node (issue 24): CRIU's, and the CUDA checkpoint API's.

1. What mxlaunch's doctor decides (mxlaunch/warmstart/engine_checkpoint.py): capabilities, `criu`, the driver's API.
2. The GPU half, measured: a child process fills --gib GiB of GPU memory with random bytes and keeps a host
   copy; this process drives the driver's checkpoint API on it (lock → checkpoint: GPU state into the
   child's host memory, the GPU memory released → restore → unlock), then the child checks every byte and
   runs a matmul. Times and the GPU memory the child held in each state are written as JSON.
3. `criu check` where criu is installed; where it passes, `criu dump --leave-running` of the checkpointed child.

    python3 scripts/probes/probe_engine_checkpoint.py --gib 8 --out $OUT/checkpoint_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mxlaunch.warmstart import engine_checkpoint  # noqa: E402

CHILD = r"""
import sys, torch
gib = float(sys.argv[1])
n = int(gib * (1 << 30)) // 4
g = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
host = g.cpu()
a = torch.randn(4096, 4096, device="cuda")
want = (a @ a).cpu()
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()  # the parent checkpoints and restores us meanwhile
same = bool(torch.equal(g.cpu(), host))
mm = bool(torch.equal((a @ a).cpu(), want))
print("checked", int(same), int(mm), flush=True)
"""

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


def gpu_mib(pid: int) -> int | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return 0


def criu_dump(pid: int, criu: str) -> dict:
    """Try CRIU's half on the checkpointed child (kept running): the dump's exit code and its last lines."""
    images = Path("/tmp/mx-criu-probe")
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True)
    t0 = time.perf_counter()
    proc = subprocess.run([criu, "dump", "--tree", str(pid), "--images-dir", str(images), "--shell-job",
                           "--leave-running", "--ext-unix-sk", "--file-locks", "--tcp-established"],
                          capture_output=True, text=True)
    rec = {"rc": proc.returncode, "s": round(time.perf_counter() - t0, 3), "out": (proc.stdout + proc.stderr)[-1500:],
           "image_mib": round(sum(f.stat().st_size for f in images.iterdir()) / (1 << 20), 1)}
    shutil.rmtree(images, ignore_errors=True)
    return rec


def gpu_half(gib: float, criu: str | None = None) -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuInit(0)
    if rc:
        return {"error": f"cuInit returned {rc}"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    rec: dict = {"gib": gib, "pid": child.pid}
    try:
        if child.stdout.readline().strip() != "ready":
            return {"error": "the child did not start", "rc": child.wait()}
        rec["gpu_mib_running"] = gpu_mib(child.pid)
        args = (ctypes.c_uint64 * 8)()
        lock_args = (ctypes.c_uint32 * 16)()
        lock_args[0] = 30000  # timeoutMs
        state = ctypes.c_int(-1)
        steps = [("lock", cuda.cuCheckpointProcessLock, lock_args), ("checkpoint", cuda.cuCheckpointProcessCheckpoint, args),
                 ("restore", cuda.cuCheckpointProcessRestore, args), ("unlock", cuda.cuCheckpointProcessUnlock, args)]
        for name, fn, arg in steps:
            t0 = time.perf_counter()
            rc = fn(child.pid, ctypes.byref(arg))
            rec[f"{name}_s"] = round(time.perf_counter() - t0, 4)
            cuda.cuCheckpointProcessGetState(child.pid, ctypes.byref(state))
            rec[f"after_{name}"] = {"rc": rc, "state": STATES.get(state.value, state.value), "gpu_mib": gpu_mib(child.pid)}
            if rc:
                rec["error"] = f"{name} returned CUresult {rc}"
                break
            if name == "checkpoint" and criu:
                rec["criu_dump"] = criu_dump(child.pid, criu)
        child.stdin.write("go\n")
        child.stdin.flush()
        answer = child.stdout.readline().split()
        rec["bytes_exact"] = answer[1:2] == ["1"]
        rec["matmul_exact"] = answer[2:3] == ["1"]
        if "checkpoint_s" in rec and rec["checkpoint_s"]:
            rec["checkpoint_gibps"] = round(gib / rec["checkpoint_s"], 2)
        if rec.get("restore_s"):
            rec["restore_gibps"] = round(gib / rec["restore_s"], 2)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    support = engine_checkpoint.probe()
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "caps_ok": support.caps_ok, "criu": support.criu,
                 "cuda_api": support.cuda_api, "driver_version": support.driver_version, "blockers": support.blockers,
                 "capeff": next((l.split()[1] for l in Path("/proc/self/status").read_text().splitlines()
                                 if l.startswith("CapEff")), None),
                 "cuda_checkpoint_tool": shutil.which("cuda-checkpoint")}
    if support.cuda_api:
        checked = None
        if support.criu:
            proc = subprocess.run([support.criu, "check"], capture_output=True, text=True)
            doc["criu_check"] = {"rc": proc.returncode, "out": (proc.stdout + proc.stderr)[-2000:]}
            checked = support.criu if proc.returncode == 0 and support.caps_ok else None
        doc["gpu_half"] = gpu_half(args.gib, checked)
    elif support.criu:
        proc = subprocess.run([support.criu, "check"], capture_output=True, text=True)
        doc["criu_check"] = {"rc": proc.returncode, "out": (proc.stdout + proc.stderr)[-2000:]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
