"""The engines' dead ipc:// socket files are removed after a run, and nothing else is (launch/ipc_leftovers.py)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from mxlaunch.engines.registry import ENGINES
from mxlaunch.engines.sglang_argv import parse_sglang_argv
from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.launch.ipc_leftovers import bound_paths, remove_engine_sockets

VLLM_NAMES = ENGINES["vllm"].ipc_socket_names


def bind(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def dead(path: Path) -> Path:
    bind(path).close()  # a closed listener leaves its file, as ZeroMQ's do
    return path


@pytest.fixture
def short_tmp() -> Path:
    """A folder with a short path (a socket path has at most 107 bytes), removed afterwards."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="mx-ipc-", dir="/tmp"))
    yield folder
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()


def vllm_spec(model: Path):
    return parse_vllm_argv(["vllm", "serve", str(model)], engine_version="0.32.0")


def test_only_this_runs_dead_engine_sockets_go(short_tmp: Path, tmp_path: Path) -> None:
    since = time.time() - 1
    gone = dead(short_tmp / str(uuid.uuid4()))
    live_path = short_tmp / str(uuid.uuid4())
    live = bind(live_path)  # a live engine's: bound, so kept
    other = dead(short_tmp / "not-an-engine-name")  # another program's socket
    plain = short_tmp / str(uuid.uuid4())
    plain.write_bytes(b"")  # a plain file under an engine's name: never a socket of its
    old = dead(short_tmp / str(uuid.uuid4()))
    os.utime(old, (since - 3600, since - 3600))  # from before this run
    try:
        assert str(live_path) in bound_paths()
        removed = remove_engine_sockets(vllm_spec(tmp_path), {"VLLM_RPC_BASE_PATH": str(short_tmp)}, since, wait_s=0.3)
        assert removed == [str(gone)]
        assert live_path.exists() and other.exists() and plain.exists() and old.exists()
    finally:
        live.close()


def test_a_socket_let_go_while_waiting_is_removed_too(short_tmp: Path, tmp_path: Path) -> None:
    """A killed process's sockets stay bound a moment after it shows as gone: the cleanup looks again."""
    import threading

    since = time.time() - 1  # before the bind (taken after it, a stall of over 1 s on a loaded box made it "older")
    path = short_tmp / str(uuid.uuid4())
    sock = bind(path)
    threading.Timer(0.3, sock.close).start()
    # the sweep returns once the socket is gone; the long bound only covers a timer thread starved on a busy box
    removed = remove_engine_sockets(vllm_spec(tmp_path), {"VLLM_RPC_BASE_PATH": str(short_tmp)}, since, wait_s=60.0)
    assert removed == [str(path)] and not path.exists()


def test_sglang_sockets_are_looked_for_in_the_temp_folder(short_tmp: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    ours = dead(short_tmp / "tmpab_cd123")
    vllm_like = dead(short_tmp / str(uuid.uuid4()))
    spec = parse_sglang_argv(["python", "-m", "sglang.launch_server", "--model-path", str(tmp_path)],
                             engine_version="0.5.23")
    assert remove_engine_sockets(spec, {}, time.time() - 5, wait_s=0.1) == [str(ours)]
    assert vllm_like.exists()


def test_the_name_patterns_are_the_engines_own() -> None:
    import re

    assert re.fullmatch(VLLM_NAMES, str(uuid.uuid4()))  # vLLM: f"{base}/{uuid4()}"
    assert not re.fullmatch(VLLM_NAMES, "vllm_dist_0a1b")
    import tempfile

    with tempfile.NamedTemporaryFile() as f:  # SGLang: NamedTemporaryFile(delete=False).name
        assert re.fullmatch(ENGINES["sglang"].ipc_socket_names, Path(f.name).name)


def test_another_users_sockets_and_links_are_left_alone(short_tmp: Path, tmp_path: Path) -> None:
    """A shared, non-sticky temp folder (TMPDIR on a careless share): another user's dead socket under an engine's
    name stays, and so does a link of theirs named like one of ours that points at a file of ours."""
    from tests.helpers.second_user import intruder_or_skip

    other = intruder_or_skip()
    os.chmod(short_tmp, 0o777)  # anyone may create and unlink in it
    ours = dead(short_tmp / str(uuid.uuid4()))
    theirs, planted, target = (short_tmp / str(uuid.uuid4()), short_tmp / str(uuid.uuid4()),
                               tmp_path / "precious")
    target.write_text("mine")
    other.python(f"""
        import os, socket
        s = socket.socket(socket.AF_UNIX); s.bind({str(theirs)!r}); s.close()
        os.symlink({str(target)!r}, {str(planted)!r})
    """)
    removed = remove_engine_sockets(vllm_spec(tmp_path), {"VLLM_RPC_BASE_PATH": str(short_tmp)}, time.time() - 5,
                                    wait_s=0.1)
    assert removed == [str(ours)]
    assert os.lstat(theirs).st_uid == other.uid and os.path.islink(planted) and target.read_text() == "mine"
