"""A stand-in "engine" for testing `mxlaunch profile`'s live mode: our process handling, not an engine.

It prints real vLLM 0.32 (CPU) start-up lines with sleeps in between, starts a child process in its
own process group (as engines do: EngineCore, workers), and then serves until it is told to stop.

    fake_vllm_engine.py [--mode ready|crash|hang|port-taken] [--port N] [--child-pid-file F] [--stubborn]

ready: reaches "Application startup complete." and waits; crash: exits 3 while loading weights;
hang: stops printing before ready; port-taken: prints uvicorn's failure to bind --port (the line SGLang
0.5.23 printed in CI) and then hangs as SGLang did. --stubborn: the child ignores SIGINT and SIGTERM (needs SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import datetime


def line(proc: str, msg: str, where: str = "core.py:100") -> None:
    stamp = datetime.now().strftime("%m-%d %H:%M:%S")
    prefix = f"({proc} pid={os.getpid()}) " if proc else ""
    sys.stdout.write(f"{prefix}INFO {stamp} [{where}] {msg}\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="ready", choices=["ready", "crash", "hang", "port-taken"])
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--child-pid-file")
    ap.add_argument("--stubborn", action="store_true")
    args = ap.parse_args()
    ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); " if args.stubborn else ""
    child = subprocess.Popen([sys.executable, "-c", f"import signal, time; {ignore}time.sleep(600)"])
    if args.child_pid_file:
        with open(args.child_pid_file, "w") as fh:
            fh.write(str(child.pid))
    time.sleep(0.3)  # an interpreter importing the engine prints nothing yet
    line("APIServer", "non-default args: {'model_tag': '/models/tiny', 'model': '/models/tiny', 'enforce_eager': True}", "utils.py:286")
    time.sleep(0.4)
    line("EngineCore", "Initializing a V1 LLM engine (v0.32.0) with config: model='/models/tiny'", "core.py:133")
    time.sleep(0.3)
    line("Worker", "world_size=1 rank=0 local_rank=0 distributed_init_method=file:///tmp/x backend=gloo", "parallel_state.py:1906")
    line("Worker", "rank 0 in world size 1 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0, ETP rank 0", "parallel_state.py:2350")
    line("Worker", "Starting to load model /models/tiny...", "cpu_model_runner.py:68")
    sys.stdout.write("\rLoading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]")
    sys.stdout.flush()
    time.sleep(0.3)
    sys.stdout.write("\rLoading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 3.3it/s]\n")
    if args.mode == "crash":
        sys.stdout.write("Traceback (most recent call last):\nRuntimeError: out of memory\n")
        sys.stdout.flush()
        child.kill()
        return 3
    line("Worker", "Loading weights took 0.31 seconds", "default_loader.py:501")
    if args.mode == "hang":
        time.sleep(600)
        return 0
    time.sleep(0.2)
    line("EngineCore", "init engine (profile, create kv cache, warmup model) took 0.20 s", "core.py:402")
    time.sleep(0.2)
    line("APIServer", "Starting vLLM server on http://0.0.0.0:8011", "entry.py:140")
    sys.stdout.write("INFO:     Started server process [%d]\nINFO:     Waiting for application startup.\n" % os.getpid())
    sys.stdout.write("INFO:     Application startup complete.\n")
    if args.mode == "port-taken":
        sys.stdout.write(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {args.port}): "
                         "address already in use\nINFO:     Waiting for application shutdown.\n")
        sys.stdout.flush()
        time.sleep(600)
        return 0
    sys.stdout.flush()
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
