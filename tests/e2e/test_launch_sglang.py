"""mxlaunch launch end to end on real SGLang 0.5.23 (CPU): the three-run proof — default serve → gold,
capture run → exact, staged restore run → exact — then a second server pulling from the staged one over
P2P → exact, plus a corrupted snapshot falling back and a killed launcher leaving nothing behind.
SGLang runs from its own venv (tests/helpers/sglang_server.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from mxlaunch.coord.peers import open_registry
from mxlaunch.store.core import MANIFEST
from tests.helpers.cli import compare_gold, run_cli
from tests.helpers.launcher import LaunchProcess
from tests.helpers.sglang_server import sglang_python, start_sglang

pytestmark = pytest.mark.live_setup  # SGLang's venv / the CRIU kit (tests/helpers/live_setup.py)

READY_S = 500


@pytest.fixture(scope="module")
def sglang_ready() -> None:
    python = sglang_python()
    if not python.exists():
        pytest.fail(f"SGLang tests need SGLang's venv at {python} — run `make sglang-venv` (make test does)")


@pytest.fixture(scope="module")
def sglang_gold(sglang_ready: None, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Gold logprobs from SGLang's own default loader (no mxlaunch anywhere)."""
    folder = tmp_path_factory.mktemp("sglang-gold")
    shm_before = set(os.listdir("/dev/shm"))
    server = start_sglang(tiny_model, folder / "server.log", timeout=READY_S)
    try:
        gold = folder / "gold.json"
        result = run_cli("verify", "--url", server.url, "--record", str(gold), "--wait", "60", "--json")
        assert result.returncode == 0, result.stderr
    finally:
        server.stop()
    # SGLang leaves its load-report segment and semaphores; the test server's stop removes them too
    leaked = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(("sglang_", "sem.mp-")))
    assert leaked == [], leaked
    yield gold


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mxstore-sglang")


compare = compare_gold


def test_gold_is_real_sglang_output(sglang_gold: Path) -> None:
    gold = json.loads(sglang_gold.read_text())
    assert gold["server"]["api"] == "sglang" and gold["server"]["engine_version"] == "0.5.23", gold["server"]
    assert gold["prompts"] and all(len(p["prompt"]) > 1 and len(p["output"]) == 32 for p in gold["prompts"])
    assert all(lp is not None for p in gold["prompts"] for _, lp in p["prompt"][1:] + p["output"])


def test_capture_run_serves_exactly_and_publishes(tiny_model: Path, sglang_gold: Path, store_root: Path) -> None:
    launch = LaunchProcess(tiny_model, store_root, engine="sglang")
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "capture", plan
        assert launch.wait_event("captured", READY_S)["rank"] == 0
        launch.wait_event("ready", READY_S)
        launch.wait_event("published", 60)
        compare(launch.url, sglang_gold)
    finally:
        launch.stop()
    sid = plan["source_id"]
    manifest = json.loads((store_root / sid / MANIFEST).read_text())
    assert manifest["engine"] == "sglang" and manifest["engine_version"] == "0.5.23", manifest
    parts = list((store_root / sid).rglob("part-*.safetensors"))
    assert parts and all(p.stat().st_size > 0 for p in parts)


def test_restore_run_is_staged_and_exact_then_a_second_server_pulls_it_over_p2p(
        tiny_model: Path, sglang_gold: Path, store_root: Path) -> None:
    """The staged run serves its raw tensors over NIXL once loaded; a second SGLang server launched beside
    it plans `p2p`, pulls them (UCX, host memory), post-processes them itself and serves SGLang's own
    numbers exactly. Stopping both with SIGTERM leaves no record in the file registry, no run folder, no
    engine process and nothing of SGLang's in /dev/shm."""
    shm_before = set(os.listdir("/dev/shm"))
    launch = LaunchProcess(tiny_model, store_root, engine="sglang")
    target = None
    procs: list = []
    codes: list = []
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "staged", plan
        loaded = launch.wait_event("loaded", READY_S)
        assert loaded["strategy"] == "staged" and loaded["bytes"] > 0, loaded
        launch.wait_event("ready", READY_S)
        compare(launch.url, sglang_gold)
        assert launch.event("fallback") is None
        assert any("mxlaunch: rank 0 loaded" in line for line in launch.stderr_lines)
        registry = open_registry(None, store_root)
        live = registry.sources(plan["source_id"], 0)
        assert len(live) == 1 and live[0].record.layout == "raw", live

        target = LaunchProcess(tiny_model, store_root, engine="sglang")
        tplan = target.wait_event("plan", 120)
        assert tplan["strategy"] == "p2p" and "live P2P source" in tplan["reason"], tplan
        pulled = target.wait_event("loaded", READY_S)
        assert pulled["strategy"] == "p2p" and pulled["source"] == live[0].record.worker, pulled
        target.wait_event("ready", READY_S)
        compare(target.url, sglang_gold)
        assert target.event("fallback") is None
        assert len(registry.sources(plan["source_id"], 0)) == 2  # the target became a source too
        procs = launch.engine_processes() + target.engine_processes()
        codes = [target.stop(signal.SIGTERM), launch.stop(signal.SIGTERM)]
    finally:
        if target is not None:
            target.stop()
        launch.stop()
    assert codes == [target.proc.returncode, launch.proc.returncode] and launch.event("exit") and target.event("exit")
    assert not Path(plan["run_dir"]).exists() and not Path(tplan["run_dir"]).exists()
    assert registry.sources(plan["source_id"], 0, include_stale=True) == []
    assert_engines_gone_and_nothing_left(procs, shm_before)


def assert_engines_gone_and_nothing_left(procs: list, shm_before: set[str]) -> None:
    """Every engine process gone, and nothing of SGLang's in /dev/shm: it leaves its load-report segment
    (and multiprocessing semaphores) behind; the launcher removes them."""
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        assert time.monotonic() < deadline, [p.pid for p in procs if p.is_running()]
        time.sleep(0.2)
    leaked = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(("sglang_", "psm_", "sem.mp-")))
    assert leaked == [], leaked


@pytest.mark.full  # the same fallback runs live on vLLM in the default run (test_launch_vllm.py)
def test_a_flipped_byte_fails_staging_and_sglang_falls_back(tiny_model: Path, sglang_gold: Path,
                                                            store_root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "store"
    shutil.copytree(store_root, broken, symlinks=True)
    part = next(p for p in broken.rglob("*.safetensors") if "/ranks/" in str(p))
    with open(part, "r+b") as fh:
        fh.seek(part.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    launch = LaunchProcess(tiny_model, broken, engine="sglang")
    try:
        assert launch.wait_event("plan", 120)["strategy"] == "staged"
        fallback = launch.wait_event("fallback", READY_S)
        assert "checksum" in fallback["reason"] or "abort" in fallback["reason"], fallback
        launch.wait_event("ready", READY_S)
        compare(launch.url, sglang_gold)  # SGLang's default loader served: still exact
    finally:
        launch.stop()


@pytest.mark.full  # the same SIGTERM stop ends the staged + P2P test above in the default run
def test_sigterm_to_the_launcher_leaves_no_files_and_no_schedulers(tiny_model: Path, store_root: Path) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    launch = LaunchProcess(tiny_model, store_root, engine="sglang")
    plan = launch.wait_event("plan", 120)
    try:
        launch.wait_event("ready", READY_S)
        procs = launch.engine_processes()
        assert any("sglang" in " ".join(p.cmdline()) or "python" in p.name() for p in procs), procs
        code = launch.stop(signal.SIGTERM)
    finally:
        launch.stop()
    assert launch.event("exit") is not None and code == launch.proc.returncode
    assert not Path(plan["run_dir"]).exists(), plan["run_dir"]
    assert_engines_gone_and_nothing_left(procs, shm_before)


STOCK_FILES = {"sharded_state": ["model-rank-0-part-0.safetensors"],  # SGLang's own file naming
               "presharded": ["checksum.json", "model-00000-common.safetensor"]}


@pytest.mark.full  # SGLang's own dump formats as an option (four starts); the raw default runs above
@pytest.mark.parametrize("fmt", sorted(STOCK_FILES))
def test_stock_format_capture_then_restore_serve_exactly(tiny_model: Path, sglang_gold: Path, tmp_path: Path,
                                                         fmt: str) -> None:
    """--snapshot-format sharded_state|presharded: SGLang's own dump and loader, compared the same way as raw."""
    store = tmp_path / "store"
    capture = LaunchProcess(tiny_model, store, engine="sglang", launch_args=("--snapshot-format", fmt))
    try:
        plan = capture.wait_event("plan", 120)
        assert plan["strategy"] == "capture" and plan["snapshot_format"] == f"sglang-{fmt}", plan
        capture.wait_event("ready", READY_S)
        capture.wait_event("published", 60)
        compare(capture.url, sglang_gold)
    finally:
        capture.stop()
    names = sorted(p.name for p in (store / plan["source_id"]).rglob("*") if p.is_file() and "/ranks/" in str(p))
    assert names == STOCK_FILES[fmt], names

    restore = LaunchProcess(tiny_model, store, engine="sglang", launch_args=("--snapshot-format", fmt))
    try:
        staged = restore.wait_event("plan", 120)
        assert staged["strategy"] == "staged" and staged["source_id"] == plan["source_id"], staged
        loaded = restore.wait_event("loaded", READY_S)
        assert loaded["strategy"] == "staged" and loaded["format"] == fmt, loaded
        restore.wait_event("ready", READY_S)
        compare(restore.url, sglang_gold)
        assert restore.event("fallback") is None
    finally:
        restore.stop()
