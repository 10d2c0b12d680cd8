#!/usr/bin/env python
"""The README's demo: `mxlaunch launch` on a tiny model made locally, served by vLLM on the CPU.

    make demo          # or: .venv/bin/python scripts/demo.py [--size 300MiB]

1. builds a random Llama + tokenizer in code (scripts/kits/make_tiny_model.py; no downloads);
2. first launch — nothing in the store yet: vLLM loads the checkpoint its own way and mxlaunch
   captures a per-rank snapshot on the way; `mxlaunch verify --record` keeps its logprobs as gold;
3. second launch — the snapshot exists: it is staged into /dev/shm while vLLM starts and the
   engine loads it as it lands; `mxlaunch verify --compare` proves the numbers are identical;
4. shows both timelines and `mxlaunch store list`; stops the servers; nothing is left in /dev/shm.
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
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launch:
    """`mxlaunch launch -- <vLLM command>` in the background, its output in a log file."""

    def __init__(self, model: Path, store: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        cmd = [*MXLAUNCH, "launch", "--artifact-path", str(store), "--",
               PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
               "--enforce-eager", "--max-model-len", "2048", "--dtype", "float32", "--host", "127.0.0.1",
               "--port", str(self.port)]
        print("$ mxlaunch launch --artifact-path " + str(store.relative_to(REPO)) + " -- python -m "
              "vllm.entrypoints.openai.api_server --model " + str(model.relative_to(REPO)) + " ...")
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=ENV, cwd=REPO,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
                raise SystemExit(f"mxlaunch launch exited with code {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    time.sleep(0.5)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"not ready after {timeout:.0f} s; see {self.log}")

    def show_mxlaunch_lines(self) -> None:
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("mxlaunch") or "mxlaunch: rank" in line:
                print("   " + line.split("] ", 1)[-1] if "mxlaunch: rank" in line else "   " + line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the launcher forwards it to the engine's process group
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="model size: tiny (default) or e.g. 300MiB")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "demo")
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.workdir / f"llama-{args.size}"
    store = args.workdir / "store"
    gold = args.workdir / "gold.json"
    running: list[Launch] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        say(f"1/4 build a random Llama ({args.size}) and its tokenizer, in code")
        if not (model / "config.json").exists():
            shutil.rmtree(model, ignore_errors=True)
            subprocess.run([PY, str(REPO / "scripts" / "kits" / "make_tiny_model.py"), "--out", str(model), "--size", args.size],
                           check=True)
        else:
            print(f"reusing {model.relative_to(REPO)}")
        shutil.rmtree(store, ignore_errors=True)  # start from an empty store: the first serve captures

        say("2/4 first launch: the engine's own loader, and mxlaunch captures a per-rank snapshot on the way")
        first = Launch(model, store, args.workdir / "launch-1.log")
        running.append(first)
        first.wait_ready(args.ready_timeout)
        reply = httpx.post(first.url + "/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox",
                                                                "max_tokens": 12, "temperature": 0}, timeout=60).json()
        print(f"   completion: {reply['choices'][0]['text']!r} (random weights, random words)")
        subprocess.run([*MXLAUNCH, "verify", "--url", first.url, "--record", str(gold)], check=True)
        first.stop()
        first.show_mxlaunch_lines()

        say("3/4 second launch: the snapshot is staged into /dev/shm while vLLM starts, then loaded as it lands")
        second = Launch(model, store, args.workdir / "launch-2.log")
        running.append(second)
        second.wait_ready(args.ready_timeout)
        verdict = subprocess.run([*MXLAUNCH, "verify", "--url", second.url, "--compare", str(gold)])
        second.stop()
        second.show_mxlaunch_lines()

        say("4/4 the artifact store")
        subprocess.run([*MXLAUNCH, "store", "list", "--artifact-path", str(store)], check=False)
        # `kept/` is not a run folder: what `launch --keep-staged` keeps for the next launch (`mxlaunch kept`)
        leftovers = [p for p in Path("/dev/shm").glob(f"mxlaunch-{os.getuid()}/*") if p.name != "kept"]
        print(f"/dev/shm run folders left behind: {len(leftovers)}")
        return verdict.returncode
    finally:
        for launch in running:
            launch.stop()


if __name__ == "__main__":
    sys.exit(main())
