"""An artifact store in an S3 bucket (store/s3_store.py, s3_capture.py, s3_prune.py, coord/s3.py,
staging/s3_stage.py): against a real S3 server (moto's server mode in its own process,
tests/helpers/s3_server.py) — capture upload and conditional publish, claims, lookup, list/verify/rm/prune
through the CLI, staging with ranged GETs, and what bad input and a dropped connection leave behind."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.staging.sources import CopyItem
from mxlaunch.staging.upload import UploadCancelled, UploadItem, UploadJob
from mxlaunch.store import s3_capture
from mxlaunch.store.opener import open_store as store_at
from mxlaunch.store.snapshot import SnapshotMeta, xxh3_file
from mxlaunch.coord.s3 import S3Coordinator
from mxlaunch.store.s3_store import S3Store
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.s3_server import S3Server, s3_environ

pytestmark = pytest.mark.unit
BUCKET = "mxstore"
META = SnapshotMeta(engine="vllm", engine_version="0.0-test", spec={"model": "/m/tiny", "tp": 2, "pp": 1},
                    identity={"test": True}, snapshot_format="mxlaunch-raw", snapshot_version=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with S3Server(tmp_path_factory.mktemp("s3")) as srv:
        srv.client().create_bucket(Bucket=BUCKET)
        yield srv


@pytest.fixture
def env(server: S3Server, tmp_path: Path) -> dict[str, str]:
    return s3_environ(server, XDG_CACHE_HOME=str(tmp_path / "cache"))


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_capture, "PART", 5 << 20)  # S3's smallest part: multipart on test-sized files


def open_store(env: dict[str, str], prefix: str) -> S3Store:
    return S3Store(f"s3://{BUCKET}/{prefix}", environ=env)


def rank_files(folder: Path, seed: int, sizes=(11 << 20, 3000)) -> dict[int, Path]:
    """Two ranks' files in a local folder (the capture's /dev/shm copy): a multipart-sized one and a small one."""
    out = {}
    for rank, size in enumerate(sizes):
        path = folder / str(rank) / "model.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size) if seed else bytes(size))
        out[rank] = path
    return out


def capture(store: S3Store, sid: str, files: dict[int, Path], capture_id: str | None = None, publish: bool = True):
    writer = store.begin_capture(sid, META, nranks=len(files), capture_id=capture_id)
    items = [UploadItem(r, "model.safetensors", p, writer.rank_dir(r) / "model.safetensors", p.stat().st_size)
             for r, p in files.items()]
    job = UploadJob(items, copy=writer.upload_copy).start()
    job.join()
    assert job.ok, job.error
    for up in job.results.values():
        writer.add_file(up.rank, up.rel, xxh3_128=up.xxh3_128)
    return writer, writer.mark_node_done(publish=publish)


def keys(server: S3Server, prefix: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def uploads(server: S3Server, prefix: str) -> list[str]:
    return [u["Key"] for u in server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []) or []]


def test_store_of_an_s3_url_is_an_s3_store(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert isinstance(store_at(f"s3://{BUCKET}/a"), S3Store)
    assert isinstance(store_at(Path(f"s3://{BUCKET}/a")), S3Store)  # pathlib's "s3:/..." (typer's Path options)
    monkeypatch.setenv("MXLAUNCH_ARTIFACT_PATH", f"s3://{BUCKET}/b")
    got = store_at()
    assert isinstance(got, S3Store) and got.url == f"s3://{BUCKET}/b"
    assert got.root == Path(env["XDG_CACHE_HOME"]) / "mxlaunch" / "s3-stores" / BUCKET / "b"


def test_capture_uploads_then_publishes_and_a_stage_gets_the_same_bytes(env: dict[str, str], server: S3Server,
                                                                        tmp_path: Path, small_parts: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.staging import s3_stage  # noqa: PLC0415

    pagers: list = []

    def recorded(dest, lands_in_mapping: bool):  # the staging's own pager, recorded, its cost limit lifted
        pager = real_pager(dest, lands_in_mapping)
        if pager is not None:
            pager.max_cost = float("inf")  # this VM's fresh memory may be dear: the path is what is under test
        pagers.append((lands_in_mapping, pager))
        return pager

    real_pager = s3_stage.tmpfs_pager
    monkeypatch.setattr(s3_stage, "tmpfs_pager", recorded)
    store = open_store(env, "cap")
    files = rank_files(tmp_path / "shm", seed=1)
    writer, won = capture(store, "sid-a", files)
    assert won
    cid = writer.capture_id
    assert keys(server, "cap/") == sorted(["cap/sid-a/manifest.json",
                                           f"cap/sid-a/data-{cid}/ranks/0/model.safetensors",
                                           f"cap/sid-a/data-{cid}/ranks/1/model.safetensors"])  # markers gone
    assert uploads(server, "cap/") == [] and not writer.tmp.exists()
    found = store.lookup("sid-a")
    assert found.snapshot is not None, found.reason
    assert found.snapshot.manifest["ranks"][0]["files"][0]["xxh3_128"] == xxh3_file(files[0])
    [entry] = store.list()
    assert (entry.source_id, entry.status, entry.bytes) == ("sid-a", "ok", sum(p.stat().st_size for p in files.values()))
    assert store.verify("sid-a").ok

    snap = found.snapshot.files_for_ranks([0, 1])
    items = [CopyItem(src=f.path, rel=f"{r}/model.safetensors", size=f.bytes) for r, f in enumerate(snap)]
    expected = {i.rel: {"bytes": f.bytes, "xxh3_128": f.xxh3_128} for i, f in zip(items, snap)}
    dest = tmp_path / "stage"
    data_keys = [k for k in keys(server, "cap/") if "/ranks/" in k]
    before = {k: server.gets(k) for k in data_keys}
    result = store.stage_job(items, dest, expected=expected, chunk=1 << 20, workers=4).start().wait()
    assert result.bytes == sum(p.stat().st_size for p in files.values())
    sizes = {f"{r}/model.safetensors": p.stat().st_size for r, p in files.items()}
    got = {k.split("/ranks/")[1]: server.gets(k) - before[k] for k in data_keys}
    assert got == {rel: -(-n // (1 << 20)) for rel, n in sizes.items()}  # from the bucket: one ranged GET a chunk
    for r, p in files.items():
        assert (dest / str(r) / "model.safetensors").read_bytes() == p.read_bytes()
    assert sorted(p.name for p in dest.rglob("*") if p.is_file()) == ["model.safetensors"] * 2  # no .incomplete
    assert (result.huge_bytes, result.huge_note) == (0, None)  # not tmpfs: 4 KiB pages, nothing to say

    shm = Path(tempfile.mkdtemp(prefix="mx-test-s3-", dir="/dev/shm"))  # tmpfs: 2 MiB pages tried, as local staging
    try:
        del pagers[:]
        result = store.stage_job(items, shm / "stage", expected=expected, chunk=4 << 20).start().wait()
        assert (shm / "stage/0/model.safetensors").read_bytes() == files[0].read_bytes()
        [(lands_in_mapping, pager)] = pagers
        assert lands_in_mapping and pager is not None  # the ranged GETs land in the mapping
        if result.huge_note and "MADV_COLLAPSE failed" in result.huge_note:
            pytest.skip(f"no 2 MiB pages on this kernel: {result.huge_note}")  # tried: the rest above has run
        assert result.huge_bytes == pager.collapsed > 0 and result.huge_note is None
    finally:
        shutil.rmtree(shm)


def test_two_captures_racing_publish_once_and_the_loser_discards_its_files(env: dict[str, str], server: S3Server,
                                                                           tmp_path: Path) -> None:
    store = open_store(env, "race")
    first, _ = capture(store, "sid-r", rank_files(tmp_path / "a", seed=1, sizes=(2000,)), publish=False)
    second, _ = capture(store, "sid-r", rank_files(tmp_path / "b", seed=1, sizes=(3000,)), publish=False)
    assert first.publish() is True
    assert second.publish() is False
    names = keys(server, "race/sid-r/")
    assert not any(second.capture_id in k for k in names) and any(first.capture_id in k for k in names)
    assert store.lookup("sid-r").snapshot.manifest["capture_id"] == first.capture_id
    with pytest.raises(CheckFailed, match="already published"):
        store.begin_capture("sid-r", META, nranks=1)


def test_a_given_up_capture_leaves_nothing_and_a_cancelled_upload_no_object(env: dict[str, str], server: S3Server,
                                                                            tmp_path: Path, small_parts: None) -> None:
    store = open_store(env, "gone")
    files = rank_files(tmp_path / "shm", seed=1)
    writer = store.begin_capture("sid-g", META, nranks=2)
    dst = writer.rank_dir(0) / "model.safetensors"
    sent: list[int] = []
    with pytest.raises(UploadCancelled):  # cancelled after its first part: the multipart upload is aborted
        writer.upload_copy(files[0], dst, progress=sent.append, cancelled=lambda: bool(sent))
    assert uploads(server, "gone/") == [] and keys(server, "gone/") == []
    writer.upload_copy(files[1], writer.rank_dir(1) / "model.safetensors")
    store.mark_node_failed("sid-g", writer.capture_id, 0, "test")
    assert store.pending("sid-g", writer.capture_id).failed == {0: "test"}
    assert keys(server, "gone/")
    assert store.discard_capture("sid-g", writer.capture_id)
    assert keys(server, "gone/") == [] and not (store.folder("sid-g") / f".tmp-{writer.capture_id}").exists()
    assert store.lookup("sid-g").snapshot is None


def test_claims_one_winner_takeover_of_an_expired_lease_and_the_old_holder_learns_it(env: dict[str, str]) -> None:
    store = open_store(env, "claims")
    here = S3Coordinator(store, host="node-a", grace_s=0.0)
    there = S3Coordinator(store, host="node-b", grace_s=0.0)
    claim = here.try_claim("sid-c", ttl_s=60, extra={"capture_id": "c1"})
    assert claim is not None and there.try_claim("sid-c", ttl_s=60) is None
    assert there.holder("sid-c").extra == {"capture_id": "c1"}
    assert claim.heartbeat()
    claim.release()
    assert there.holder("sid-c") is None
    again = there.try_claim("sid-c", ttl_s=0.001)  # a lease that is over at once: anyone may take it over
    assert again is not None and here.holder("sid-c") is None
    taker = here.try_claim("sid-c", ttl_s=60)
    assert taker is not None
    assert not again.heartbeat() and again.lost  # the old holder's conditional PUT fails: it knows
    racers = [S3Coordinator(store, host=f"n{i}", grace_s=0.0) for i in range(4)]
    taker.release()
    won = []
    threads = [threading.Thread(target=lambda c=c: won.append(c.try_claim("sid-c", ttl_s=60))) for c in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for w in won if w is not None) == 1


def test_a_dead_holder_on_this_host_frees_the_claim_at_once(env: dict[str, str]) -> None:
    import subprocess
    import sys

    store = open_store(env, "dead")
    coord = S3Coordinator(store)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    claim = coord.try_claim("sid-d", ttl_s=600)
    assert claim is not None
    from dataclasses import replace

    dead = replace(claim.info, pid=proc.pid, start_time=1)  # a process of this boot that is gone
    coord.put("sid-d", dead, {"IfMatch": claim.etag})
    assert coord.holder("sid-d") is None and coord.try_claim("sid-d", ttl_s=60) is not None


def test_store_commands_list_verify_rm_on_s3(env: dict[str, str], server: S3Server, tmp_path: Path) -> None:
    store = open_store(env, "cli")
    files = rank_files(tmp_path / "shm", seed=1, sizes=(4096, 5000))
    writer, _ = capture(store, "sid-v", files)
    url = f"s3://{BUCKET}/cli"
    listed = run_cli("store", "list", "--artifact-path", url, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert doc["root"] == url and [(s["source_id"], s["status"]) for s in doc["snapshots"]] == [("sid-v", "ok")]
    ok = run_cli("store", "verify", "sid-v", "--artifact-path", url, env=env)
    assert ok.returncode == 0 and "checksums match" in ok.stdout, ok.stdout + ok.stderr
    key = f"cli/sid-v/data-{writer.capture_id}/ranks/1/model.safetensors"
    flipped = bytearray(files[1].read_bytes())
    flipped[100] ^= 0xFF
    server.client().put_object(Bucket=BUCKET, Key=key, Body=bytes(flipped))
    assert run_cli("store", "verify", "sid-v", "--quick", "--artifact-path", url, env=env).returncode == 0
    bad = run_cli("store", "verify", "sid-v", "--artifact-path", url, env=env)
    assert bad.returncode == 1 and "checksum" in one_line_error(bad)
    server.client().put_object(Bucket=BUCKET, Key=key, Body=b"short")
    assert "bytes, the manifest says" in store.lookup("sid-v").reason
    assert run_cli("store", "rm", "sid-v", "--artifact-path", url, env=env).returncode == 0
    assert keys(server, "cli/sid-v/") == []
    missing = run_cli("store", "verify", "sid-v", "--artifact-path", url, env=env)
    assert missing.returncode == 2 and "no snapshot sid-v" in one_line_error(missing)


def test_prune_removes_unclaimed_leftovers_keeps_claimed_ones_and_old_snapshots_by_age(env: dict[str, str],
                                                                                       server: S3Server, tmp_path: Path) -> None:
    store = open_store(env, "prune")
    capture(store, "sid-p", rank_files(tmp_path / "a", seed=1, sizes=(1000,)))
    left, _ = capture(store, "sid-q", rank_files(tmp_path / "b", seed=1, sizes=(1000,)), publish=False)
    held, _ = capture(store, "sid-h", rank_files(tmp_path / "c", seed=1, sizes=(1000,)), publish=False)
    claim = store.coordinator.try_claim("sid-h", ttl_s=600)
    url = f"s3://{BUCKET}/prune"
    dry = run_cli("store", "prune", "--artifact-path", url, "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert [i["name"] for i in report["removed"]] == [f"sid-q/{left.capture_id}"]
    assert [i["name"] for i in report["skipped"]] == [f"sid-h/{held.capture_id}"]
    assert keys(server, "prune/sid-q/")  # a dry run changes nothing
    done = run_cli("store", "prune", "--artifact-path", url, "--unused-for", "0s", env=env)
    assert done.returncode == 0, done.stderr
    assert keys(server, "prune/sid-q/") == [] and keys(server, "prune/sid-p/") == []
    assert keys(server, "prune/sid-h/")  # its claim is held
    claim.release()


@pytest.mark.parametrize("case", ["no-such-bucket", "no-credentials", "bad-url"])
def test_bad_input_is_one_line_exit_2(env: dict[str, str], case: str) -> None:
    url = {"no-such-bucket": "s3://no-such-bucket/p", "bad-url": "s3://B!/p"}.get(case, f"s3://{BUCKET}/p")
    if case == "no-credentials":
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    result = run_cli("store", "list", "--artifact-path", url, env=env)
    line = one_line_error(result)
    assert result.returncode == 2, result.stderr
    expected = {"no-such-bucket": "does not exist", "no-credentials": "AWS_ACCESS_KEY_ID", "bad-url": "s3://bucket/prefix"}[case]
    assert expected in line and " — " in line, line


class DroppingProxy:
    """A TCP proxy to the S3 server that cuts every response after `keep` bytes (a server dropping the
    connection mid-file); requests other than GET pass whole."""

    def __init__(self, target_port: int, keep: int) -> None:
        self.target_port, self.keep = target_port, keep
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.target_port))
        first = conn.recv(65536)
        is_get = first.startswith(b"GET ")
        up.sendall(first)

        def pump_up() -> None:
            try:
                while data := conn.recv(65536):
                    up.sendall(data)
            except OSError:
                pass

        threading.Thread(target=pump_up, daemon=True).start()
        sent = 0
        try:
            while data := up.recv(65536):
                if is_get and sent + len(data) > self.keep:
                    conn.sendall(data[: self.keep - sent])
                    break
                conn.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (conn, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_a_connection_dropped_mid_file_fails_the_stage_cleanly_and_the_next_starts_afresh(
        env: dict[str, str], server: S3Server, tmp_path: Path) -> None:
    store = open_store(env, "drop")
    files = rank_files(tmp_path / "shm", seed=1, sizes=(3 << 20,))
    capture(store, "sid-x", files)
    snap = store.lookup("sid-x").snapshot
    [f] = snap.files_for_ranks([0])
    items = [CopyItem(src=f.path, rel="0/model.safetensors", size=f.bytes)]
    expected = {"0/model.safetensors": {"bytes": f.bytes, "xxh3_128": f.xxh3_128}}
    proxy = DroppingProxy(server.port, keep=200_000)
    try:
        dropping = open_store({**env, "AWS_ENDPOINT_URL": proxy.url}, "drop")
        dest = tmp_path / "shm-run" / "stage"
        job = dropping.stage_job(items, dest, expected=expected, chunk=1 << 20, workers=2).start()
        with pytest.raises(CheckFailed, match="failed 3 times") as failed:
            job.wait()
        assert " — " in failed.value.one_line()
        assert not dest.exists() or not any(dest.rglob("*"))  # nothing partial left in /dev/shm
    finally:
        proxy.close()
    result = store.stage_job(items, dest, expected=expected, chunk=1 << 20).start().wait()
    assert result.bytes == f.bytes and (dest / "0/model.safetensors").read_bytes() == files[0].read_bytes()


def test_a_wrong_checksum_fails_the_stage_and_leaves_nothing(env: dict[str, str], tmp_path: Path) -> None:
    store = open_store(env, "sum")
    capture(store, "sid-s", rank_files(tmp_path / "shm", seed=1, sizes=(70000,)))
    [f] = store.lookup("sid-s").snapshot.files_for_ranks([0])
    items = [CopyItem(src=f.path, rel="0/model.safetensors", size=f.bytes)]
    dest = tmp_path / "stage"
    job = store.stage_job(items, dest, expected={"0/model.safetensors": {"bytes": f.bytes, "xxh3_128": "0" * 32}}).start()
    with pytest.raises(CheckFailed, match="arrived wrong"):
        job.wait()
    assert not dest.exists() or not any(dest.rglob("*"))
    with pytest.raises(UsageError):  # S3's own paths stay inside the store
        store.key_of("/elsewhere/x")


@pytest.mark.parametrize("case", ["no-such-bucket", "no-credentials"])
def test_a_launch_on_a_bad_s3_store_is_one_line_exit_2(env: dict[str, str], tmp_path: Path, case: str) -> None:
    import sys

    from tests.helpers.tiny_model import cached_model

    model = cached_model(tmp_path / "models")
    url = "s3://no-such-bucket/p" if case == "no-such-bucket" else f"s3://{BUCKET}/p"
    if case == "no-credentials":
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    result = run_cli("launch", "--dry-run", "--artifact-path", url, "--", sys.executable, "-m",
                     "vllm.entrypoints.openai.api_server", "--model", str(model), env=env)
    line = one_line_error(result)
    assert result.returncode == 2 and ("does not exist" if case == "no-such-bucket" else "AWS_ACCESS_KEY_ID") in line, line
