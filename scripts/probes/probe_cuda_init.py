#!/usr/bin/env python3
"""What opens the GPU's device files while vLLM is imported, and whether CUDA IPC works between processes forked
from such a parent (issues 23, 24). On the H200 (2026-12-04) a zygote that had imported vLLM's API server held
/dev/nvidiactl and /dev/nvidia0 open (CRIU: "Can't dump file ... chr 195:255"), and a P2P target could not
open its source's CUDA IPC handles (CUresult 1). Found with this probe: vLLM's platform detection initialises
NVML at import (the zygote now shuts it down before a dump), and IPC failed in every case, spawned processes
too — mxlaunch's handle was cut at its first NUL byte (fixed; docs/benchmarks.md, 2026-12-04).
Run on the GPU machine:

    source /tmp/kit/device_env.sh && python3 scripts/probes/probe_cuda_init.py --out $OUT/cuda_init.json

Part 1 (`imports`): import a module (vLLM's API server) in a fresh interpreter with torch's device-count entry
points wrapped: the stack of every call that initialises the driver (cudaGetDeviceCount → cuInit), a watcher's
first sight of each /dev/nvidia* file, and the device files still open at the end — as is, and with
PYTORCH_NVML_BASED_CUDA_CHECK=1 (torch counts devices through NVML, no cuInit).
Part 2 (`ipc`): 64 MiB exported by one process through mxlaunch's CUDA IPC driver calls and opened, copied and
compared by another; both forked from a parent that (a) touched nothing, (b) called torch.cuda.device_count()
(cuInit), (c) counted through NVML, (e) imported vLLM's API server; and (d) two spawned interpreters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

IMPORT_PROBE = r'''
import json, os, sys, threading, time, traceback
sys.path.insert(0, sys.argv[2])
from mxlaunch.plugin.zygote_dump import device_files  # what the zygote checks before a dump (stdlib only)
sys.setswitchinterval(1e-4)
t0 = time.perf_counter()
main = threading.main_thread().ident
seen, calls, stop = {}, [], []

def watch():
    while not stop:
        for path in device_files():
            if path not in seen:
                frame = sys._current_frames().get(main)
                seen[path] = {"at_s": round(time.perf_counter() - t0, 3),
                              "stack": traceback.format_stack(frame)[-14:] if frame else []}
        time.sleep(0.0005)

threading.Thread(target=watch, daemon=True).start()
import torch
real = getattr(torch._C, "_cuda_getDeviceCount", None)  # a CPU build has none
def counted():
    calls.append({"at_s": round(time.perf_counter() - t0, 3), "stack": traceback.format_stack()[-14:-1]})
    return real()
if real is not None:
    torch._C._cuda_getDeviceCount = counted
import importlib
importlib.import_module(sys.argv[1])
took = time.perf_counter() - t0
time.sleep(0.05)
stop.append(1)
print("PROBE " + json.dumps({"import_s": round(took, 2), "driver_init_calls": calls[:4], "n_calls": len(calls),
                            "first_seen": seen, "open_at_end": device_files(),
                            "torch_cuda_initialized": torch.cuda.is_initialized()}))
'''

IPC_PROBE = r'''
import json, multiprocessing as mp, os, sys, time
sys.path.insert(0, sys.argv[2])
from mxlaunch.plugin.zygote_dump import device_files
MiB = 1 << 20

def source(conn):
    try:
        import torch
        from mxlaunch.transfer.cuda_ipc import Driver
        t = torch.arange(16 * MiB, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        d = Driver(); d.on_device(0)
        base, size = d.allocation(t.data_ptr())
        conn.send({"handle": d.export(base), "base": base, "ptr": t.data_ptr()})
    except Exception as exc:  # noqa: BLE001 — the verdict names it
        conn.send({"error": f"source: {exc!r}"})
        return
    conn.recv()

def target(conn, out):
    try:
        import torch
        from mxlaunch.transfer.cuda_ipc import Driver
        got = torch.empty(16 * MiB, dtype=torch.int32, device="cuda")
        d = Driver(); d.on_device(0)
    except Exception as exc:  # noqa: BLE001
        out.send(f"target: {exc!r}"); conn.recv(); conn.send("done"); return
    msg = conn.recv()
    if "error" in msg:
        out.send(msg["error"]); return
    try:
        mapped = d.open(msg["handle"])
        d.copy(got.data_ptr(), mapped + msg["ptr"] - msg["base"], 64 * MiB, 0); d.wait(0)
        ok = bool(torch.equal(got.cpu(), torch.arange(16 * MiB, dtype=torch.int32)))
        d.close(mapped)
        out.send("exact" if ok else "copied, bytes differ")
    except OSError as exc:
        out.send(f"open/copy: {exc}")
    conn.send("done")  # the source may exit now

if __name__ == "__main__":
    variant = sys.argv[1]
    t0 = time.perf_counter()
    if variant in ("device_count", "nvml_count"):
        import torch
        torch.cuda.device_count()
    elif variant == "vllm_import":
        import vllm.entrypoints.openai.api_server  # noqa: F401
    held = device_files()
    ctx = mp.get_context("spawn" if variant == "spawn" else "fork")
    a, b = ctx.Pipe()
    r, w = ctx.Pipe(duplex=False)
    ps = [ctx.Process(target=source, args=(a,)), ctx.Process(target=target, args=(b, w))]
    for p in ps:
        p.start()
    verdict = r.recv() if r.poll(180) else "no answer in 180 s"
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
    print("PROBE " + json.dumps({"variant": variant, "parent_device_files": held, "ipc": verdict,
                                "seconds": round(time.perf_counter() - t0, 1)}))
'''


def probe(code: str, args: list[str], env: dict[str, str], timeout: float) -> dict:
    """Runs the code as a file (multiprocessing's spawn re-imports the main module from its path)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="mx_probe_") as f:
        f.write(code)
        f.flush()
        try:
            proc = subprocess.run([sys.executable, f.name, *args], capture_output=True, text=True, env=env,
                                  timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
    if line is None:
        return {"rc": proc.returncode, "stderr_tail": proc.stderr[-1500:]}
    return json.loads(line[6:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", default="vllm.entrypoints.openai.api_server")
    ap.add_argument("--parts", default="imports,ipc")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    nvml = {**base, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    doc: dict = {"module": args.module, "imports": {}, "ipc": {}}
    parts = args.parts.split(",")
    if "imports" in parts:
        for name, env in (("as_is", base), ("nvml_count", nvml)):
            doc["imports"][name] = got = probe(IMPORT_PROBE, [args.module, str(REPO)], env, 300)
            print(name, json.dumps({k: got.get(k) for k in ("import_s", "n_calls", "open_at_end", "rc")}), flush=True)
            for call in got.get("driver_init_calls", [])[:2]:
                print("  cuInit via:", "".join(call["stack"][-6:]), flush=True)
    if "ipc" in parts:
        for variant in ("nothing", "device_count", "nvml_count", "spawn", "vllm_import"):
            env = nvml if variant == "nvml_count" else base
            doc["ipc"][variant] = got = probe(IPC_PROBE, [variant, str(REPO)], env, 300)
            print("ipc", variant, json.dumps(got), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
