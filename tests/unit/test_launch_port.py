"""The engine's HTTP port: a port held before the launch is one line and exit 2 with nothing started; a
port taken while the engine starts (uvicorn's bind error, after which SGLang hangs) stops the engine at once
instead of waiting out the ready timeout. The bind-error line is the one SGLang 0.5.23 printed in CI."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from mxlaunch.errors import UsageError
from mxlaunch.fileutil import pid_alive
from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch import port
from mxlaunch.launch.cleanup import ENGINE_SHM_PREFIXES, SHM_ROOT, shm_user_root
from mxlaunch.store.core import Store
from tests.helpers.cli import run_cli
from tests.helpers.vllm_server import free_port
from tests.unit.test_launch_plan import serve, write_checkpoint

PY = sys.executable
FAKE = Path(__file__).resolve().parent / "fixtures_logs" / "fake_vllm_engine.py"
CI_LINE = ("[2026-12-03 20:33:23] ERROR:    [Errno 98] error while attempting to bind on address "
           "('127.0.0.1', 38741): address already in use")


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", free_port()))
    sock.listen()
    return sock


def test_a_free_port_passes_and_a_listening_one_names_its_holder() -> None:
    port.check_free("127.0.0.1", free_port())
    with listening() as held:
        number = held.getsockname()[1]
        with pytest.raises(UsageError) as caught:
            port.check_free("127.0.0.1", number)
        line = caught.value.one_line()
        assert f"port {number} on 127.0.0.1 is already in use" in line and "another --port" in line
        assert f"pid {os.getpid()}" in line  # this process holds it, and psutil may see our own sockets
        with pytest.raises(UsageError):
            port.check_free(None, number)  # no --host: the engine binds every interface, 127.0.0.1 included


def test_an_address_of_another_machine_is_named() -> None:
    with pytest.raises(UsageError) as caught:
        port.check_free("192.0.2.1", free_port())  # TEST-NET-1: never an address of this machine
    assert "--host 192.0.2.1 is not an address of this machine" in caught.value.one_line()


def test_the_bind_failure_is_read_from_uvicorns_line_for_this_port_only() -> None:
    assert port.bind_failure(CI_LINE, 38741) == "the engine could not bind its HTTP port 38741: address already in use"
    assert port.bind_failure(CI_LINE, 3874) is None  # another port's failure is not ours
    torch_store = ("The server socket has failed to listen on any local network address. port: 38741, useIPv6: 0, "
                   "code: -98, name: EADDRINUSE, message: address already in use")
    assert port.bind_failure(torch_store, 38741) is None  # not the HTTP server: the engine exits on its own
    assert port.bind_failure("INFO:     Application startup complete.", 38741) is None


def _entries(folder: Path) -> set[str]:
    return set(os.listdir(folder)) if folder.is_dir() else set()


def _owner_alive(run_dir: Path) -> bool:
    try:
        return pid_alive(int(json.loads((run_dir / "owner.json").read_text())["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def left_in_shm(top_before: set[str], runs_before: set[str]) -> set[str]:
    """What a launcher that has exited left in /dev/shm. Other processes may run meanwhile (`make test` runs the
    live lane beside this one): their engines' segments and the run folders of launchers still alive (owner.json
    names a live pid) are theirs, not a leftover."""
    root = shm_user_root()
    top = {n for n in _entries(SHM_ROOT) - top_before if n != root.name and not n.startswith(ENGINE_SHM_PREFIXES)}
    runs = {f"{root.name}/{n}" for n in _entries(root) - runs_before if not _owner_alive(root / n)}
    return top | runs


def test_launch_on_a_held_port_is_one_line_exit_2_and_starts_nothing(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    top_before, runs_before = _entries(SHM_ROOT), _entries(shm_user_root())
    with listening() as held:
        number = held.getsockname()[1]
        result = run_cli("launch", "--artifact-path", str(tmp_path / "store"), "--run-dir", str(tmp_path / "run"),
                         "--", *serve(model, "--host", "127.0.0.1", "--port", str(number)))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "already in use" in line]
    assert len(errors) == 1 and f"port {number}" in errors[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run" / "engine.log").exists()  # the engine never started (no segments of its own)
    assert not list((tmp_path / "store").rglob("*.safetensors"))  # nothing captured
    assert left_in_shm(top_before, runs_before) == set()


def test_a_port_taken_after_the_check_stops_the_hanging_engine_at_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.launch import cleanup
    from mxlaunch.launch.run import Launcher

    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path / "shm")
    number = free_port()
    store = Store(tmp_path / "store")
    opts = LaunchOptions(artifact_path=store.root, strategy="default", run_dir=tmp_path / "logs", ready_timeout=300)
    plan = make_plan(serve(write_checkpoint(tmp_path / "model"), "--port", str(number)), opts, store)
    plan.argv = plan.spec.argv = [PY, str(FAKE), "--mode", "port-taken", "--port", str(number)]
    events: list[tuple[str, dict]] = []
    launcher = Launcher(plan, opts, emit=lambda e, **f: events.append((e, f)), echo=lambda line: None, store=store)
    assert launcher.run() == 1
    [error] = [f["message"] for e, f in events if e == "error"]
    assert error.startswith(f"the engine could not bind its HTTP port {number}: address already in use — "), error
    assert launcher.stop_reason and "ready" not in [e for e, _ in events]
    assert launcher.proc is not None and launcher.proc.poll() is not None  # stopped, not left hanging
    assert not launcher.shm_dir.exists()


def test_a_port_a_stopped_server_left_in_time_wait_counts_as_free() -> None:
    """A server that just stopped leaves the connections it closed first in TIME_WAIT on its port; uvicorn binds
    with SO_REUSEADDR and gets the port, so the check must call it free too (a relaunch right after a stop)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's (its connections inherit it)
    server.bind(("127.0.0.1", free_port()))
    server.listen()
    number = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", number))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first ...
    server.close()
    client.settimeout(30)
    assert client.recv(1) == b""  # ... its FIN arrived
    client.close()
    with socket.socket() as plain, pytest.raises(OSError) as taken:  # a bind without SO_REUSEADDR still fails
        plain.bind(("127.0.0.1", number))
    assert taken.value.errno == errno.EADDRINUSE
    port.check_free("127.0.0.1", number)
