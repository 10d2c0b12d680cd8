"""The warm interpreter (plugin/zygote.py) and the launcher's side of it (warmstart/zygote.py), with real
processes: a zygote of this Python forks children that run a small module written here, and the handle the
launcher gets drives them like a Popen (output, exit codes, signals, the lifeline)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.warmstart import zygote
from mxlaunch.launch.engine_start import plan_engine_start
from mxlaunch.engines.registry import parse_command
from mxlaunch.plan import PLAN_ENV
from mxlaunch.plugin.zygote import READY_LINE, script_imports

CHILD = '''
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "marker", os.environ.get("MX_MARKER"), "pgid", os.getpgid(0) == os.getpid(), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[1]))
'''


@pytest.fixture()
def module_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="mxz", dir="/tmp"))  # a Unix socket's path has 107 bytes at most
    (root / "mxz_child.py").write_text(CHILD)
    monkeypatch.setattr(zygote, "SHM_ROOT", root / "shm")
    (root / "shm").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _env(module_dir: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(module_dir), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", **more}


def _entry(args: tuple[str, ...] = ()) -> zygote.ZygoteEntry:
    return zygote.ZygoteEntry(sys.executable, "module", "mxz_child", args, ("json",))


def _start(module_dir: Path, env: dict[str, str], idle_s: float = 60.0) -> tuple[str, int]:
    key = zygote.zygote_key(_entry(), "1", env, str(module_dir))
    pid = zygote.start_zygote(key, _entry(), env, str(module_dir), module_dir / "logs", idle_s=idle_s)
    assert pid is not None
    deadline = time.monotonic() + 60
    while not zygote.socket_path(key).exists():  # published only once its imports are done
        done, _ = os.waitpid(pid, os.WNOHANG)
        assert done == 0 and time.monotonic() < deadline, (module_dir / "logs" / "zygote.log").read_text()
        time.sleep(0.05)
    return key, pid


def _output(child: zygote.ZygoteChild) -> str:
    return child.stdout.read().decode()


def _wait_exit(pid: int, timeout: float = 120.0) -> int:
    """The exit code of our child `pid`, waited for with a deadline: one that hangs is killed and the test fails
    (a plain waitpid would hang the suite instead)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"process {pid} did not exit in {timeout:.0f} s (killed)")
        time.sleep(0.02)


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        _wait_exit(pid, 60)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_a_forked_child_gets_the_request_s_argv_env_folder_and_group_and_its_exit_code_comes_back(module_dir: Path) -> None:
    env = _env(module_dir)
    key, pid = _start(module_dir, env)
    try:
        work = module_dir / "work"
        work.mkdir()
        child = zygote.fork_from(key, _entry(("7",)), {**env, "MX_MARKER": "req"}, str(work))
        assert child is not None
        assert child.wait(timeout=30) == 7
        out = _output(child)
        assert f"argv ['7'] cwd {work} marker req pgid True" in out, out
        again = zygote.fork_from(key, _entry(("0",)), env, str(work))  # the zygote serves more than one start
        assert again is not None and again.wait(timeout=30) == 0
        (listed,) = zygote.list_zygotes()  # what `mxlaunch zygotes` shows
        assert (listed.key, listed.status, listed.pid, listed.entry) == (key, "waiting", pid, "module mxz_child")
    finally:
        _stop(pid)
    assert not zygote.socket_path(key).exists()  # a stopped zygote removes its socket


def test_a_signal_to_the_child_s_group_and_a_dead_launcher_both_end_it(module_dir: Path) -> None:
    env = _env(module_dir)
    key, pid = _start(module_dir, env)
    try:
        child = zygote.fork_from(key, _entry(("sleep",)), env, str(module_dir))
        assert child is not None
        assert child.stdout.readline().startswith(b"argv ['sleep']")
        assert child.poll() is None
        os.killpg(child.pid, signal.SIGKILL)  # what process.stop_group does in the end
        assert child.wait(timeout=30) == -signal.SIGKILL

        orphan = zygote.fork_from(key, _entry(("sleep",)), env, str(module_dir))
        assert orphan is not None
        assert orphan.stdout.readline().startswith(b"argv")
        os.close(orphan._lifeline)  # as when the launcher dies: the child's lifeline reads EOF
        assert orphan.wait(timeout=30) == -signal.SIGTERM
    finally:
        _stop(pid)


def test_no_zygote_or_a_dead_socket_means_spawn_and_the_dead_socket_goes(module_dir: Path) -> None:
    env = _env(module_dir)
    assert zygote.fork_from("nokey", _entry(), env, str(module_dir)) is None
    root = zygote.zygote_root()
    root.mkdir(mode=0o700)
    dead = zygote.socket_path("deadkey")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()  # bound, never listening: a zygote that was killed -9
    assert zygote.fork_from("deadkey", _entry(), env, str(module_dir)) is None
    assert not dead.exists()


def test_an_idle_zygote_exits_and_so_does_one_whose_socket_is_removed(module_dir: Path) -> None:
    env = _env(module_dir)
    key = zygote.zygote_key(_entry(), "1", env, str(module_dir))
    pid = zygote.start_zygote(key, _entry(), env, str(module_dir), module_dir / "logs", idle_s=0.5)
    assert pid is not None
    code = _wait_exit(pid)  # not whether we catch it serving: what it did, from its exit and its log
    log = (module_dir / "logs" / "zygote.log").read_text()
    assert code == 0, log  # ended on its own: nobody stopped it or removed its socket
    assert f"{READY_LINE} imported=" in log and f"pid={pid}" in log, log  # it published its socket
    assert "not serving" not in log and "bad request" not in log, log
    assert not zygote.socket_path(key).exists()  # (how long it waits first: the fake-clock test below)
    assert zygote.list_zygotes() == []  # its info file went with it
    key, pid = _start(module_dir, env)
    assert zygote.stop_zygotes() == [key]  # `mxlaunch zygotes --stop`: its socket goes, and so does it
    assert _wait_exit(pid) == 0
    assert zygote.list_zygotes() == []


def test_stopping_the_zygotes_removes_their_folder_once_nothing_is_left_in_it(module_dir: Path) -> None:
    """Issue 42: /dev/shm/mxlaunch-zygote-<uid> stayed after `mxlaunch zygotes --stop` (its import TMPDIR in it)."""
    from mxlaunch.warmstart.zygote_env import IMPORT_TMPDIR

    key, pid = _start(module_dir, _env(module_dir))
    root = zygote.zygote_root()
    assert (root / IMPORT_TMPDIR).is_dir()
    assert zygote.stop_zygotes() == [key]
    assert _wait_exit(pid) == 0
    assert not root.exists()
    (root / IMPORT_TMPDIR).mkdir(parents=True, mode=0o700)
    (root / IMPORT_TMPDIR / "left").write_text("x")  # something still in it: the folder stays, and what is in it
    assert zygote.stop_zygotes() == [] and (root / IMPORT_TMPDIR / "left").exists()


def test_the_serving_loop_returns_only_after_idle_s_without_a_request_or_once_its_socket_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote's loop on a clock that moves only when its select waits out its timeout: it returns once
    idle_s has passed with no request and no child, not before; a removed socket ends it at its next wake."""
    from mxlaunch.plugin import zygote_server as plugin

    clock = [1000.0]

    def waited(_r: list, _w: list, _x: list, timeout: float) -> tuple[list, list, list]:
        clock[0] += timeout  # nothing arrived in `timeout` seconds
        return [], [], []

    monkeypatch.setattr(plugin, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(plugin, "select", types.SimpleNamespace(select=waited))
    sock = tmp_path / "z.sock"
    sock.touch()
    loop = plugin.Zygote(str(sock), ("module", "m"), idle_s=5.0)
    loop.listener, loop.inode = socket.socket(socket.AF_UNIX), os.stat(sock).st_ino
    try:
        loop.serve()
        assert clock[0] - 1000.0 > 5.0 and clock[0] - 1000.0 <= 5.0 + 2.0  # idle_s, then the first wake after it
        loop.idle_s, start = 3600.0, clock[0]
        sock.unlink()
        loop.serve()
        assert clock[0] - start <= 2.0  # the socket is gone: not ours to serve
    finally:
        loop.listener.close()


def test_the_key_ignores_which_run_this_is_and_nothing_else(tmp_path: Path) -> None:
    entry = _entry(("--port", "1"))
    base = {"PATH": "/bin", "VLLM_X": "1"}
    key = zygote.zygote_key(entry, "0.26.0", base, "/w")
    assert key == zygote.zygote_key(_entry(("--port", "2")), "0.26.0", {**base, PLAN_ENV: "/dev/shm/x/plan.json",
                                                                         "SLURM_STEP_ID": "3"}, "/w")
    for other in (zygote.zygote_key(entry, "0.27.0", base, "/w"), zygote.zygote_key(entry, "0.26.0", base, "/v"),
                  zygote.zygote_key(entry, "0.26.0", {**base, "VLLM_X": "2"}, "/w")):
        assert other != key


def test_which_commands_a_zygote_can_run(tmp_path: Path) -> None:
    py = sys.executable
    entry, _ = zygote.entry_for([py, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], py, py, ("a",))
    assert entry is not None and (entry.kind, entry.target, entry.args, entry.preload) == (
        "module", "vllm.entrypoints.openai.api_server", ("--model", "m"), ("a",))
    assert entry.child_argv() == ["vllm.entrypoints.openai.api_server", "--model", "m"]
    script = tmp_path / "vllm"
    script.write_text(f"#!{py}\nimport re\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    entry, _ = zygote.entry_for([str(script), "serve", "m"], py, str(script), ())
    assert entry is not None and (entry.kind, entry.target, entry.args) == ("path", str(script), ("serve", "m"))
    assert script_imports(str(script)) == ["re", "sys", "vllm.entrypoints.cli.main"]
    for argv in ([py, "-X", "importtime", "-m", "x"], [py, "script.py"]):
        entry, why = zygote.entry_for(argv, py, py, ())
        assert entry is None and why
    assert zygote.entry_for(["vllm", "serve"], None, None, ())[0] is None


def test_the_plan_forks_vllm_s_engine_core_on_cuda_only_and_keeps_a_user_s_choice() -> None:
    spec = parse_command(["vllm", "serve", "m"])
    assert plan_engine_start(spec, spec.argv, "cuda", {}, None).env == {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    kept = plan_engine_start(spec, spec.argv, "cuda", {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, None)
    assert kept.env == {} and "kept" in kept.fork_reason
    assert plan_engine_start(spec, spec.argv, "cpu", {}, None).env == {}
    assert plan_engine_start(spec, spec.argv, "cuda", {}, None, fork=False).env == {}
    off = plan_engine_start(spec, spec.argv, "cuda", {}, None)
    assert off.zygote is None and "--zygote" in off.zygote_reason
    sg = parse_command(["python", "-m", "sglang.launch_server", "--model-path", "m"])
    assert plan_engine_start(sg, sg.argv, "cuda", {}, None).env == {}


def test_the_plan_says_why_the_engine_core_is_not_forked_and_no_reason_repeats_off() -> None:
    """Issue 42: the CPU build spawns whatever is asked, so no flag is the reason there; on CUDA the option that
    turned fork off is named; and the dry run's "zygote off: <reason>" must not read "zygote off: off"."""
    spec = parse_command(["vllm", "serve", "m"])
    cpu = plan_engine_start(spec, spec.argv, "cpu", {}, None, fork=False, no_fork_by="--engine-snapshot")
    assert cpu.env == {} and "spawns its engine core" in cpu.fork_reason and "--" not in cpu.fork_reason
    cuda = plan_engine_start(spec, spec.argv, "cuda", {}, None, fork=False, no_fork_by="--engine-snapshot")
    assert cuda.env == {} and "--engine-snapshot" in cuda.fork_reason
    assert not plan_engine_start(spec, spec.argv, "cuda", {}, None).zygote_reason.startswith("off")


def test_a_zygote_whose_imports_start_a_thread_refuses_says_why_and_is_not_started_again(module_dir: Path) -> None:
    (module_dir / "mxz_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True, name='busy').start()\n")
    env = _env(module_dir)
    entry = zygote.ZygoteEntry(sys.executable, "module", "mxz_child", (), ("mxz_thread",))
    key = zygote.zygote_key(entry, "1", env, str(module_dir))
    pid = zygote.start_zygote(key, entry, env, str(module_dir), module_dir / "logs")
    assert pid is not None
    assert _wait_exit(pid) == 3
    assert not zygote.socket_path(key).exists()
    why = zygote.refusal(key)
    assert why is not None and "busy" in why and "thread" in why
    assert zygote.start_zygote(key, entry, env, str(module_dir), module_dir / "logs") is None
    assert zygote.fork_from(key, entry, env, str(module_dir)) is None
    assert [(z.key, z.status) for z in zygote.list_zygotes()] == [(key, "refused")]


def test_a_zygote_folder_others_can_enter_is_never_used(module_dir: Path) -> None:
    """A request carries the engine's environment (tokens too): never to a socket in a folder others can reach."""
    env = _env(module_dir)
    key, pid = _start(module_dir, env)
    try:
        os.chmod(zygote.zygote_root(), 0o755)
        assert zygote.fork_from(key, _entry(("0",)), env, str(module_dir)) is None
        assert zygote.socket_path(key).exists()  # not ours to judge: left alone
        with pytest.raises(OSError, match="0700"):
            zygote.start_zygote("other", _entry(), env, str(module_dir), module_dir / "logs")
        os.chmod(zygote.zygote_root(), 0o700)
        child = zygote.fork_from(key, _entry(("0",)), env, str(module_dir))
        assert child is not None and child.wait(timeout=30) == 0
    finally:
        _stop(pid)


INTRUDER_REQUEST = '''
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
r, w = os.pipe()
try:
    socket.send_fds(s, [b"x"], [r, w])
    s.sendall(json.dumps({"argv": ["x"], "env": {}, "cwd": "/"}).encode() + b"\\n")
    data = s.recv(100)
except OSError:  # the zygote closed the connection while the request was on its way
    data = b""
print("reply", data)
'''


def test_a_request_from_another_uid_is_refused_by_the_kernels_word_on_the_peer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with the socket reachable (here: a folder and socket others may use), a request whose peer is another
    uid (SO_PEERCRED) is closed before its descriptors or its request are read: nothing is forked for it."""
    import subprocess

    from mxlaunch.plugin import zygote_server as plugin
    from tests.helpers.second_user import SYSTEM_PYTHON, intruder_or_skip

    intruder = intruder_or_skip()
    folder = Path(tempfile.mkdtemp(prefix="mxzp", dir="/tmp"))
    try:
        folder.chmod(0o755)
        sock_path = str(folder / "z.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0)
        try:
            listener.bind(sock_path)
        finally:
            os.umask(old)
        listener.listen(4)
        loop = plugin.Zygote(sock_path, ("module", "m"), idle_s=60.0)
        loop.listener = listener
        forks: list[int] = []

        def no_fork() -> int:
            forks.append(1)
            raise RuntimeError("forked for a request")

        monkeypatch.setattr(plugin.os, "fork", no_fork)
        proc = subprocess.Popen([SYSTEM_PYTHON, "-c", INTRUDER_REQUEST, sock_path], user=intruder.uid,
                                group=intruder.gid, extra_groups=[], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
        try:
            loop._accept()  # blocks until the intruder connects
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            listener.close()
        assert forks == [], "a request from another uid was served"
        assert "reply b''" in out, (out, err)  # closed without an answer
    finally:
        shutil.rmtree(folder, ignore_errors=True)
