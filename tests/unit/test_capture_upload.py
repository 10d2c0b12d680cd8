"""A capture through node-local /dev/shm (issue 11): the plugin writes into the run folder in /dev/shm, the
launcher uploads into the store in the background once the engine is ready, and publishes as before.

Real parts throughout: a real Store in tmp_path (ext4 here, so not tmpfs), the real /dev/shm for the
capture copy, the real plugin (`RankLoad` + `capture_tensors`) or a stand-in engine process that writes
parts and markers as the plugin does (tests/helpers/capture_nodes.py), real `CaptureSession`s and
`Launcher`s. Faults are real (a file where the store's rank folder must be, a sparse checkpoint larger
than /dev/shm) or come in through the session's `copy` seam (a copy that fails half-way, a slow one).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.fileutil import is_tmpfs
from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch.run import Launcher
from mxlaunch.launch import capture_upload as upload_mod
from mxlaunch.launch.capture import CaptureSession
from mxlaunch.launch.capture_route import decide_capture_route, estimate_node_bytes
from mxlaunch.plan import Plan
from mxlaunch.staging.capacity import capacity_of
from mxlaunch.staging.upload import UploadCancelled, UploadItem, UploadJob, copy_file
from mxlaunch.store.core import MANIFEST, Store
from mxlaunch.store.snapshot import xxh3_file
from tests.helpers.capture_nodes import engine_argv, rank_bytes
from tests.helpers.cli import run_cli
from tests.helpers.vllm_server import free_port
from tests.unit.test_launch_plan import serve, write_checkpoint

pytestmark = pytest.mark.unit
PY = sys.executable
SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A folder in the real /dev/shm (tmpfs), removed afterwards."""
    if not is_tmpfs(SHM):
        pytest.skip("no tmpfs at /dev/shm")
    path = SHM / f"mxlaunch-test-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pending_parts(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("data-", ".nodes-", ".tmp-", ".trash-")))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def messages(events: list[tuple[str, dict]], name: str) -> list[str]:
    return [f.get("message", "") for e, f in events if e == name]


# ---- where the capture goes ------------------------------------------------------------------------------


def test_a_store_on_disk_routes_the_capture_through_dev_shm(tmp_path: Path) -> None:
    assert not is_tmpfs(tmp_path), "this test needs tmp_path on a disk filesystem"
    store = Store(tmp_path / "store")
    plan = make_plan(serve(write_checkpoint(tmp_path / "model"), "-tp", "2"), LaunchOptions(artifact_path=store.root), store)
    assert plan.strategy == "capture" and plan.capture_via == "shm", plan.capture_via_reason
    assert "is not on tmpfs" in plan.capture_via_reason and "once the engine is ready" in plan.capture_via_reason
    doc = plan.to_json()
    assert doc["capture_via"] == "shm" and doc["capture_via_reason"] == plan.capture_via_reason
    assert doc["capture_bytes"] == plan.capture_bytes > 0


def test_the_estimate_splits_the_checkpoint_over_the_ranks_and_widens_16_bit_to_float32(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    weights = (model / "model.safetensors").stat().st_size
    store = Store(tmp_path / "store")
    one = make_plan(serve(model), LaunchOptions(artifact_path=store.root), store)
    two = make_plan(serve(model, "-tp", "2"), LaunchOptions(artifact_path=store.root), store)
    (one_bytes, one_ranks), (two_bytes, two_ranks) = estimate_node_bytes(one), estimate_node_bytes(two)
    assert one_ranks == [0] and two_ranks == [0, 1]
    assert weights <= one_bytes - (16 << 20) <= weights * 1.06  # the checkpoint, with a small margin
    assert two_bytes - 2 * (16 << 20) == pytest.approx(one_bytes - (16 << 20), abs=2)  # two halves of it
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    wide = make_plan(serve(model, "--dtype", "float32"), LaunchOptions(artifact_path=store.root), store)
    assert estimate_node_bytes(wide)[0] - (16 << 20) == pytest.approx(2 * (one_bytes - (16 << 20)), abs=2)


def test_off_tmpfs_store_or_no_room_write_straight_to_the_store_and_say_why(tmp_path: Path, shm_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_checkpoint(tmp_path / "model")
    store = Store(tmp_path / "store")
    opts = LaunchOptions(artifact_path=store.root)
    monkeypatch.setenv("MXLAUNCH_CAPTURE_VIA_SHM", "off")
    off = make_plan(serve(model), opts, store)
    assert off.capture_via == "store" and "MXLAUNCH_CAPTURE_VIA_SHM=off" in off.capture_via_reason
    monkeypatch.delenv("MXLAUNCH_CAPTURE_VIA_SHM")
    on_tmpfs = Store(shm_dir / "store")  # a store that is in /dev/shm already
    plan = make_plan(serve(model), LaunchOptions(artifact_path=on_tmpfs.root), on_tmpfs)
    assert plan.capture_via == "store" and "is on tmpfs already" in plan.capture_via_reason
    # a checkpoint larger than /dev/shm (and this disk) can take: a sparse 8 TiB file
    os.truncate(model / "model.safetensors", 8 << 40)
    big = make_plan(serve(model), opts, store)
    assert big.strategy == "capture" and big.capture_via == "store"
    assert big.capture_via_reason.startswith("no room in /dev/shm for this node's capture: snapshot rank(s) [0] need about 8")
    assert "the capture is written straight into the store" in big.capture_via_reason
    assert big.capture_bytes > 8 << 40
    # the engine's own copy counts on a CPU node: half of /dev/shm's room for the capture is not enough
    usable = capacity_of(SHM).usable
    os.truncate(model / "model.safetensors", int(usable * 0.6))
    cpu = make_plan(serve(model), opts, store)
    assert cpu.device_type == "cpu" and cpu.capture_via == "store" and "the CPU engine holds itself" in cpu.capture_via_reason
    assert decide_capture_route(cpu, store.root).via == "store"


def test_the_dry_run_says_where_the_capture_goes(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    as_json = run_cli("launch", "--dry-run", "--json", "--artifact-path", str(tmp_path / "store"), "--", *serve(model))
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["schema"] == 1 and doc["strategy"] == "capture" and doc["capture_via"] == "shm"
    text = run_cli("launch", "--dry-run", "--artifact-path", str(tmp_path / "store"), "--", *serve(model))
    assert "capture via shm: the store" in text.stdout.replace("\n", " "), text.stdout


# ---- the upload job --------------------------------------------------------------------------------------


def test_copy_file_checksums_what_it_writes_and_never_leaves_half_a_file(tmp_path: Path, shm_dir: Path) -> None:
    src = shm_dir / "part.safetensors"
    src.write_bytes(os.urandom((3 << 20) + 17))
    size, digest = copy_file(src, tmp_path / "part.safetensors", chunk=1 << 20)
    assert size == src.stat().st_size and digest == xxh3_file(src) == xxh3_file(tmp_path / "part.safetensors")
    calls = []

    def cancel_after_two() -> bool:
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(Exception, match="cancelled"):
        copy_file(src, tmp_path / "other.safetensors", chunk=1 << 20, cancelled=cancel_after_two)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.safetensors"]  # no temp file, no half file


def test_the_first_failure_cancels_the_other_files(tmp_path: Path, shm_dir: Path) -> None:
    items = []
    for i in range(6):
        (shm_dir / f"p{i}.safetensors").write_bytes(bytes([i]) * (1 << 20))
        items.append(UploadItem(0, f"p{i}.safetensors", shm_dir / f"p{i}.safetensors", tmp_path / f"p{i}.safetensors", 1 << 20))
    items[0] = UploadItem(0, "p0.safetensors", shm_dir / "p0.safetensors", tmp_path / "missing" / "p0.safetensors", 1 << 20)
    job = UploadJob(items, writers=1, chunk=1 << 16).start()  # largest first, then in order: p0 fails first
    assert job.join(30)
    assert not job.running and not job.ok and "p0.safetensors of rank 0" in (job.error or "")
    assert job.results == {} and list(tmp_path.glob("*.safetensors")) == []


# ---- a session's capture through /dev/shm ---------------------------------------------------------------


class Session:
    """A capturing node's CaptureSession on a real store, its capture copy in the real /dev/shm."""

    def __init__(self, tmp: Path, shm: Path, argv: list[str], store: Path | None = None, **kw: object) -> None:
        self.store = Store(store or tmp / "store")
        self.events: list[tuple[str, dict]] = []
        self.plan = make_plan(argv, LaunchOptions(artifact_path=self.store.root, kernel_cache=False, p2p=False,
                                                  capture_id=kw.pop("capture_id", None)), self.store)  # type: ignore[arg-type]
        assert self.plan.strategy == "capture" and self.plan.capture_via == "shm", self.plan.reason
        self.local = shm / f"capture-{secrets.token_hex(3)}"
        self.session = CaptureSession(self.store, self.plan, lambda e, **f: self.events.append((e, f)),
                                      local_root=self.local, **kw)  # type: ignore[arg-type]
        assert self.session.start() is None
        self.folder = self.store.root / self.plan.source_id

    def names(self) -> list[str]:
        return [e for e, _ in self.events]

    def plugin_writes(self, run: Path) -> dict[str, str]:
        """The real plugin captures each worker into the plan's capture_dir and writes its marker; the
        launcher's part (on_captured) follows each marker. Returns {snapshot rel path: xxh3}."""
        import torch
        from torch import nn

        from mxlaunch.plugin.rank_load import RankLoad

        capture_dir, ranks = self.session.plan_fields()
        plan = Plan(strategy="capture", source_id=self.plan.source_id, run_dir=str(run), capture_dir=capture_dir,
                    capture_ranks=ranks)
        for worker in map(int, ranks):
            torch.manual_seed(worker)
            model = nn.Linear(64, 32)
            RankLoad(model, plan, worker, lambda: None, engine="T", log=logging.getLogger("t")).run()
            assert (run / "markers" / f"captured-{worker}.json").exists()
            self.session.on_captured(worker)
        return {f"{p.parent.name}/{p.name}": xxh3_file(p) for p in files_under(Path(capture_dir))}

    def poll_until(self, *states: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.session.state not in states:
            assert time.monotonic() < deadline, (self.session.state, self.events)
            self.session.poll()
            time.sleep(0.02)


def test_the_capture_lands_in_dev_shm_uploads_once_ready_and_publishes_the_same_bytes(tmp_path: Path, shm_dir: Path) -> None:
    node = Session(tmp_path, shm_dir, serve(write_checkpoint(tmp_path / "model"), "-tp", "2"))
    assert node.session.plan_fields()[0] == str(node.local) and is_tmpfs(node.local)
    written = node.plugin_writes(tmp_path / "run")
    assert sorted(written) == ["0/part-00000.safetensors", "1/part-00000.safetensors"]
    # every rank is in /dev/shm; the engine is not ready yet: nothing moves to the store
    assert node.session.state == "uploading" and node.session.upload is None
    for _ in range(3):
        node.session.poll()
    assert files_under(node.folder) == [] and not (node.folder / MANIFEST).exists()
    node.session.engine_ready()
    node.poll_until("published")
    names = node.names()
    assert names.index("upload") < names.index("uploaded") < names.index("published"), names
    upload = dict(node.events)["upload"]
    assert upload["source"] == str(node.local) and upload["files"] == 2 and upload["ranks"] == [0, 1]
    found = node.store.lookup(node.plan.source_id).snapshot
    assert found is not None and node.store.verify(node.plan.source_id).ok
    recorded = {f["path"].split("/ranks/")[1]: f["xxh3_128"] for r in found.manifest["ranks"] for f in r["files"]}
    assert recorded == written  # the checksums of the bytes the plugin wrote, file by file
    assert not node.local.exists() and files_under(shm_dir) == []  # the /dev/shm copy is gone
    assert pending_parts(node.folder) == [f"data-{node.session.capture_id}"]
    assert node.store.coordinator.holder(node.plan.source_id) is None  # claim released


def test_keep_staged_keeps_the_uploaded_copy_for_the_next_launch_to_link(tmp_path: Path, shm_dir: Path) -> None:
    """`--keep-staged` on the first serve: the capture's /dev/shm copy, once uploaded, is this snapshot's kept
    files — exactly what the next launch's staged plan asks for (name, size, the manifest's checksum), so a
    restart right after a capture reads nothing from the store."""
    from mxlaunch.staging import kept

    user_root = shm_dir / "user"
    user_root.mkdir(mode=0o700)
    argv = serve(write_checkpoint(tmp_path / "model"), "-tp", "2")
    node = Session(tmp_path, shm_dir, argv, keep_root=user_root)
    node.plugin_writes(tmp_path / "run")
    node.session.engine_ready()
    node.poll_until("published")
    assert [f for e, f in node.events if e == "kept"][0]["status"] == "kept"
    assert not node.local.exists()  # the capture folder goes; the kept links hold the bytes
    staged = make_plan(argv, LaunchOptions(artifact_path=node.store.root, kernel_cache=False, p2p=False), node.store)
    assert staged.strategy == "staged" and staged.stage_bytes > 0
    assert kept.available(user_root, staged.source_id, staged.stage_expected()) == staged.stage_bytes
    dest = shm_dir / "next-stage"
    dest.mkdir(mode=0o700)
    assert kept.reuse(user_root, staged.source_id, staged.stage_expected(), dest).bytes == staged.stage_bytes
    for f in staged.stage_files:  # the linked bytes are the store's, file by file
        rel = str(f.path).split("/ranks/")[1]
        assert xxh3_file(dest / rel) == f.xxh3_128


def test_a_capture_given_up_keeps_nothing(tmp_path: Path, shm_dir: Path) -> None:
    from mxlaunch.staging import kept

    user_root = shm_dir / "user"
    user_root.mkdir(mode=0o700)
    node = Session(tmp_path, shm_dir, serve(write_checkpoint(tmp_path / "model"), "-tp", "2"), keep_root=user_root)
    node.plugin_writes(tmp_path / "run")
    node.session.engine_ready()
    node.poll_until("published")
    assert kept.entries(user_root)
    node.session.state = "uploading"  # as if the publish had not happened yet: the session is given up
    node.session._give_up("a test")
    assert kept.entries(user_root) == []


def half_then_enospc(src: Path, dst: Path, **kw: object) -> tuple[int, str]:
    """A store that fills up half-way through the first file."""
    tmp = dst.with_name(f".{dst.name}.upload.tmp")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        fout.write(fin.read(src.stat().st_size // 2))
    tmp.unlink()  # copy_file's own rule: a failed copy leaves no temp file
    raise OSError(errno.ENOSPC, "No space left on device", str(dst))


@pytest.mark.parametrize("fault", ["copy fails half-way", "a file where the rank folder must be"])
def test_a_failed_upload_publishes_nothing_cleans_dev_shm_and_says_what_to_fix(tmp_path: Path, shm_dir: Path,
                                                                               fault: str) -> None:
    copy = half_then_enospc if fault == "copy fails half-way" else None
    node = Session(tmp_path, shm_dir, serve(write_checkpoint(tmp_path / "model"), "-tp", "2"), copy=copy)
    writer = node.session.writer
    assert writer is not None
    if fault != "copy fails half-way":
        shutil.rmtree(writer.tmp / "ranks" / "1")
        (writer.tmp / "ranks" / "1").write_bytes(b"in the way")
    node.plugin_writes(tmp_path / "run")
    node.session.engine_ready()
    node.poll_until("failed")
    errors = messages(node.events, "error")
    assert len(errors) == 1 and "published nothing: uploading snapshot rank(s) [0, 1] from /dev/shm into the store failed: " in errors[0]
    assert errors[0].endswith(f"— check free space, quota and permissions on {node.store.root} (or set "
                              "MXLAUNCH_CAPTURE_VIA_SHM=off to write straight into the store)")
    assert ("No space left on device" if copy else "File exists") in errors[0]
    assert "published" not in node.names() and not (node.folder / MANIFEST).exists()
    assert pending_parts(node.folder) == []  # nothing half-published, no temp folder
    assert not node.local.exists() and files_under(shm_dir) == []
    assert node.store.coordinator.holder(node.plan.source_id) is None  # the next launch captures again
    node.session.close()
    assert node.session.failed and len(messages(node.events, "error")) == 1


def wait_for_gate_or_cancel(gate: threading.Event, cancelled) -> None:
    """Block until the test opens `gate` (then return) or the upload is cancelled (then raise, as copy_file
    does); 600 s at most, so that a broken cancel fails the test instead of hanging the thread for ever."""
    deadline = time.monotonic() + 600
    while not gate.wait(0.01):
        if cancelled():
            raise UploadCancelled("cancelled while held")
        if time.monotonic() > deadline:
            raise OSError("the test never opened the gate")


def gated_copy(gate: threading.Event):
    """The real copy, but held before its first byte until the test opens `gate`: an upload that is still
    running for as long as the test needs it to (a cancel ends the wait)."""
    def copy(src: Path, dst: Path, *, chunk: int, progress, cancelled) -> tuple[int, str]:
        wait_for_gate_or_cancel(gate, cancelled)
        return copy_file(src, dst, chunk=chunk, progress=progress, cancelled=cancelled)
    return copy


def copy_one_chunk_then_hold(src: Path, dst: Path, *, chunk: int, progress, cancelled) -> tuple[int, str]:
    """The real copy, 1 KiB at a time, that stops after its first chunk until it is cancelled: some bytes
    done, never all of them."""
    never = threading.Event()

    def hold(n: int) -> None:
        progress(n)
        wait_for_gate_or_cancel(never, cancelled)
    return copy_file(src, dst, chunk=1024, progress=hold, cancelled=cancelled)


def test_closing_during_the_upload_cancels_it_and_leaves_nothing(tmp_path: Path, shm_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_mod, "PROGRESS_S", 0.1)
    node = Session(tmp_path, shm_dir, serve(write_checkpoint(tmp_path / "model")), copy=copy_one_chunk_then_hold)
    node.plugin_writes(tmp_path / "run")
    node.session.engine_ready()
    job = node.session.upload
    assert job is not None and job.running
    deadline = time.monotonic() + 30
    while not (progress := [f for e, f in node.events if e == "upload" and f.get("done", 0) > 0]):
        assert time.monotonic() < deadline, node.events  # a progress line while it runs, once a chunk is in
        node.session.poll()
        time.sleep(0.05)
    assert 0 < progress[0]["done"] < progress[0]["bytes"]
    assert progress[0]["message"].startswith("uploaded ") and "GiB/s" in progress[0]["message"]
    assert job.running  # the copy holds until it is cancelled: only close() can end it
    node.session.close()  # the launcher's exit path: the engine stopped
    assert job.join(60) and job.cancelled and not job.running  # ended by the cancel (its copy never ends otherwise)
    assert node.session.failed and "stopped before its upload from /dev/shm into the store was done" in messages(node.events, "error")[0]
    assert not (node.folder / MANIFEST).exists() and pending_parts(node.folder) == []
    assert not node.local.exists() and files_under(shm_dir) == []


def test_each_node_of_a_multinode_capture_uploads_its_own_ranks_before_its_part_is_done(tmp_path: Path,
                                                                                        shm_dir: Path) -> None:
    """Over several nodes the upload starts as soon as a node's ranks are written (the holder's wait runs
    from its own part); a node's marker is written only after its upload, and the holder publishes once."""
    model = write_checkpoint(tmp_path / "model")
    gate = threading.Event()  # the holder's upload copies nothing until the test opens it
    holder = Session(tmp_path, shm_dir, engine_argv(model, 0, 2, 2), capture_id="job1", copy=gated_copy(gate))
    member = Session(tmp_path, shm_dir, engine_argv(model, 1, 2, 2), capture_id="job1")
    try:
        assert holder.session.holder and not member.session.holder
        holder.plugin_writes(tmp_path / "run0")
        member.plugin_writes(tmp_path / "run1")
        assert holder.session.upload is not None and member.session.upload is not None  # no engine_ready needed
        markers = holder.folder / ".nodes-job1"
        assert holder.session.upload.running and not (markers / "0.json").exists()  # the holder still uploads
        member.poll_until("waiting")
        assert (markers / "1.json").exists() and not member.local.exists()
        holder.session.poll()
        assert holder.session.state == "uploading" and not (markers / "0.json").exists()  # held: no marker yet
    finally:
        gate.set()
    holder.poll_until("published", timeout=60)
    member.poll_until("published")
    found = holder.store.lookup(holder.plan.source_id).snapshot
    assert found is not None and found.manifest["nnodes"] == 2 and holder.store.verify(found.source_id).ok
    assert pending_parts(holder.folder) == ["data-job1"] and files_under(shm_dir) == []


# ---- real launchers around a stand-in engine ------------------------------------------------------------


def run_launcher(tmp: Path, model: Path, *, capture_only: bool = True, parts: int = 2,
                 on_event=None, keep_staged: bool = False) -> tuple[Launcher, int, list[tuple[str, dict]]]:
    """One node's real Launcher (run folder in the real /dev/shm) around the stand-in engine, which
    writes `parts` parts per rank as the plugin does and then answers /health."""
    store = Store(tmp / "store")
    port = free_port()
    opts = LaunchOptions(artifact_path=store.root, kernel_cache=False, p2p=False, capture_only=capture_only,
                         run_dir=tmp / "logs", ready_timeout=120, keep_staged=keep_staged)
    plan = make_plan(serve(model, "-tp", "2", "--port", str(port)), opts, store)
    plan.argv = [PY, "-m", "tests.helpers.capture_nodes", "engine", "--parts", str(parts), "--port", str(port)]
    events: list[tuple[str, dict]] = []

    def emit(event: str, **fields: object) -> None:
        events.append((event, fields))
        if on_event is not None:
            on_event(runner, event, fields)

    runner = Launcher(plan, opts, emit=emit, echo=lambda line: None, store=store)
    cwd = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[2])  # the engine runs tests.helpers.capture_nodes
    try:
        code = runner.run()
    finally:
        os.chdir(cwd)
    return runner, code, events


def stop_when_published(runner: Launcher, event: str, fields: dict) -> None:
    if event == "published":
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()


@pytest.mark.parametrize("capture_only", [False, True])
def test_a_launch_captures_into_dev_shm_uploads_and_publishes(tmp_path: Path, capture_only: bool) -> None:
    """A serving launch uploads once the engine is ready; --capture-only (which stops the engine when the
    snapshot is published) uploads as soon as every rank is captured."""
    runner, code, events = run_launcher(tmp_path, write_checkpoint(tmp_path / "model"), capture_only=capture_only,
                                        on_event=None if capture_only else stop_when_published)
    names = [e for e, _ in events]
    assert code in ((0,) if capture_only else (0, 128 + signal.SIGTERM)), events
    plan = dict(events)["plan"]
    assert plan["capture_via"] == "shm" and "is not on tmpfs" in plan["capture_via_reason"]
    assert dict(events)["capture-via"]["via"] == "shm"
    assert names.index("captured") < names.index("upload") < names.index("uploaded") < names.index("published"), names
    if not capture_only:
        assert names.index("ready") < names.index("upload"), names
    assert runner.capture is not None and runner.capture.upload_at_once is capture_only
    upload = dict(events)["upload"]
    assert upload["source"] == str(runner.shm_dir / "capture") and upload["source"].startswith("/dev/shm/")
    assert upload["files"] == 4 and upload["bytes"] == sum(len(rank_bytes(r, p)) for r in (0, 1) for p in (0, 1))
    store = Store(tmp_path / "store")
    sid = plan["source_id"]
    found = store.lookup(sid).snapshot
    assert found is not None and store.verify(sid).ok
    import xxhash
    for rank in found.manifest["ranks"]:
        for f in rank["files"]:
            part = int(f["path"].rsplit("part-", 1)[1].split(".")[0])
            assert f["xxh3_128"] == xxhash.xxh3_128(rank_bytes(rank["rank"], part)).hexdigest()
    assert not runner.shm_dir.exists()  # the run folder, with the capture copy, is gone
    assert pending_parts(store.root / sid) == [f"data-{found.manifest['capture_id']}"]


def test_a_launch_with_keep_staged_keeps_its_capture_copy(tmp_path: Path) -> None:
    """The launcher hands the session this user's root when --keep-staged is on: the uploaded copy is kept."""
    from mxlaunch.staging import kept

    runner, code, events = run_launcher(tmp_path, write_checkpoint(tmp_path / "model"), keep_staged=True)
    sid = dict(events)["plan"]["source_id"]
    try:
        assert code == 0, events
        assert [f["status"] for e, f in events if e == "kept"] == ["kept"], events
        [entry] = [e for e in kept.entries(runner.shm_dir.parent) if e.source_id == sid]
        assert entry.files == 4 and entry.bytes == dict(events)["upload"]["bytes"]
    finally:
        kept.drop(runner.shm_dir.parent, sid)


def test_no_room_in_dev_shm_captures_straight_into_the_store(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    os.truncate(model / "model.safetensors", 8 << 40)  # sparse: larger than /dev/shm, takes no blocks
    runner, code, events = run_launcher(tmp_path, model)
    assert code == 0, events
    plan = dict(events)["plan"]
    assert plan["capture_via"] == "store" and plan["capture_via_reason"].startswith("no room in /dev/shm")
    assert dict(events)["capture-via"]["message"].startswith("no room in /dev/shm")
    names = [e for e, _ in events]
    assert "upload" not in names and "published" in names
    assert Store(tmp_path / "store").verify(plan["source_id"]).ok


def test_a_failed_upload_keeps_the_engine_serving_and_publishes_nothing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_mod, "copy_file", half_then_enospc)  # the session's copy seam (looked up at upload)
    seen: dict[str, object] = {}

    def on_event(runner: Launcher, event: str, fields: dict) -> None:
        if event == "error" and "engine_alive" not in seen:
            seen["engine_alive"] = runner.proc is not None and runner.proc.poll() is None
            seen["capture_files"] = files_under(runner.shm_dir / "capture")
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()  # then stop the launch

    runner, code, events = run_launcher(tmp_path, write_checkpoint(tmp_path / "model"), capture_only=False,
                                        on_event=on_event)
    assert seen == {"engine_alive": True, "capture_files": []}, events
    errors = [f["message"] for e, f in events if e == "error"]
    assert len(errors) == 1 and "from /dev/shm into the store failed: part-0000" in errors[0]
    assert "No space left on device" in errors[0]
    assert "published" not in [e for e, _ in events]
    sid = dict(events)["plan"]["source_id"]
    assert Store(tmp_path / "store").lookup(sid).snapshot is None and pending_parts(tmp_path / "store" / sid) == []
    assert code in (0, 128 + signal.SIGTERM) and not runner.shm_dir.exists()


def test_a_stop_signal_during_the_upload_gives_the_capture_up_quickly(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()  # never opened while the launcher runs: only a cancel ends the upload's copies
    monkeypatch.setattr(upload_mod, "copy_file", gated_copy(gate))
    stopped: list[bool] = []

    def on_event(runner: Launcher, event: str, fields: dict) -> None:
        if event == "upload" and not stopped:
            stopped.append(True)
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()

    try:
        runner, code, events = run_launcher(tmp_path, write_checkpoint(tmp_path / "model"), capture_only=False,
                                            on_event=on_event)
        assert runner.capture is not None and runner.capture.upload is not None
        assert runner.capture.upload.join(60) and runner.capture.upload.cancelled  # it was cancelled, not waited for
    finally:
        gate.set()
    names = [e for e, _ in events]
    assert stopped, events
    assert "stopping" in names and "uploaded" not in names and "published" not in names
    errors = [f["message"] for e, f in events if e == "error"]
    assert len(errors) == 1 and "stopped before its upload from /dev/shm into the store was done" in errors[0]
    sid = dict(events)["plan"]["source_id"]
    assert Store(tmp_path / "store").lookup(sid).snapshot is None and pending_parts(tmp_path / "store" / sid) == []
    assert Store(tmp_path / "store").coordinator.holder(sid) is None
    assert not runner.shm_dir.exists()
    assert runner.capture is not None and runner.capture.upload is not None and not runner.capture.upload.running


def test_the_largest_files_are_copied_first(tmp_path: Path) -> None:
    """The job's length is its largest file's copy: begun first, it is not left to start last on an idle pool."""
    sizes = [3, 700, 40, 5000, 1]
    items = [UploadItem(0, f"f{n}", tmp_path / f"f{n}", tmp_path / "out" / f"f{n}", n) for n in sizes]
    order: list[int] = []

    def copy(src: Path, dst: Path, **_: object) -> tuple[int, str]:
        order.append(int(src.name[1:]))
        return int(src.name[1:]), "x"

    job = UploadJob(items, writers=1, copy=copy).start()
    job.join()
    assert job.ok and order == sorted(sizes, reverse=True)
