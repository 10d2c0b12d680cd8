"""Secrets stay out of what a launch prints and writes (issue 41 item 6), without a live engine: the dry run in both
forms, the plan file, the manifest, the log files' modes; and a model path that names nothing is one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.safety.logfile import open_log
from mxlaunch.plan import Plan, load_plan
from mxlaunch.safety.ownership import ForeignPath
from mxlaunch.store.core import SnapshotMeta, build_manifest
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.second_user import intruder_or_skip
from tests.unit.test_launch_plan import write_checkpoint

API_KEY, HF_TOKEN, REDIS_PW = "sk-unit-apikey-4417", "hf_unittoken_9925", "unit-redis-pw-3381"
REGISTRY = f"redis://:{REDIS_PW}@127.0.0.1:1/0"


def _command(model: Path) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--api-key", API_KEY, f"--hf-token={HF_TOKEN}"]


@pytest.mark.parametrize("as_json", [True, False])
def test_dry_run_shows_no_secret(tmp_path: Path, as_json: bool) -> None:
    model = write_checkpoint(tmp_path / "model")
    env = {**os.environ, "HF_TOKEN": HF_TOKEN}
    result = run_cli("launch", "--dry-run", *(["--json"] if as_json else []), "--artifact-path", str(tmp_path / "store"),
                     "--", *_command(model), env=env)
    assert result.returncode == 0, result.stderr
    for secret in (API_KEY, HF_TOKEN):
        assert secret not in result.stdout + result.stderr
    if as_json:
        argv = json.loads(result.stdout)["argv"]
        assert argv[argv.index("--api-key") + 1] == "***" and "--hf-token=***" in argv
        assert str(model) in argv  # the rest of the command as it was
    else:
        assert "--api-key *** --hf-token=***" in " ".join(result.stdout.split())  # rich wraps long lines


def test_plan_file_names_the_registry_redacted_and_the_plugin_gets_it_back(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    plan = Plan(strategy="default", source_id="0" * 16, run_dir=str(run),
                p2p={"registry": REGISTRY, "layout": "raw", "world": 1, "run_id": "r", "serve": True, "timeout_s": 1.0})
    path = run / "plan.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(plan.to_json())
    assert REDIS_PW not in path.read_text() and "redis://:***@127.0.0.1:1/0" in path.read_text()
    monkeypatch.setenv("MXLAUNCH_REGISTRY", REGISTRY)  # what the launcher gives the engine (launch/run.py _env)
    loaded = load_plan(path)
    assert loaded is not None and loaded.p2p is not None and loaded.p2p["registry"] == REGISTRY
    monkeypatch.setenv("MXLAUNCH_REGISTRY", "redis://:other@127.0.0.1:2/0")  # another URL: not put back
    assert load_plan(path).p2p["registry"] == "redis://:***@127.0.0.1:1/0"  # type: ignore[union-attr]


def test_manifest_holds_no_secret_of_the_command() -> None:
    spec = {"model": "/m", "argv": ["vllm", "serve", "/m", "--api-key", API_KEY, f"--hf-token={HF_TOKEN}"]}
    manifest = build_manifest("0" * 16, "c", SnapshotMeta(engine="vllm", spec=spec, identity={"model": "/m"}), 1, 1,
                              {0: [{"path": "ranks/0/a.safetensors", "bytes": 1}]})
    text = json.dumps(manifest)
    assert API_KEY not in text and HF_TOKEN not in text and "/m" in manifest["spec"]["argv"]


def test_logs_are_private_and_never_written_through_a_link(tmp_path: Path) -> None:
    old = tmp_path / "engine.log"
    old.write_bytes(b"an old run's lines\n")
    old.chmod(0o644)
    with open_log(old) as fh:
        fh.write(b"new\n")
    assert stat.S_IMODE(old.stat().st_mode) == 0o600 and old.read_bytes() == b"new\n"
    with open_log(tmp_path / "zygote.log", append=True) as fh:
        fh.write(b"a\n")
    with open_log(tmp_path / "zygote.log", append=True) as fh:
        fh.write(b"b\n")
    assert stat.S_IMODE((tmp_path / "zygote.log").stat().st_mode) == 0o600
    assert (tmp_path / "zygote.log").read_bytes() == b"a\nb\n"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "planted.log").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo.log")
    for name in ("planted.log", "fifo.log"):
        with pytest.raises(ForeignPath):
            open_log(tmp_path / name)
    assert victim.read_text() == "keep"


@pytest.mark.parametrize("model", ["/nonexistent/model", "./no-such-model", "../no-such-model", "~/no-such-model-41"])
def test_a_model_path_that_names_nothing_is_one_line_and_exit_2(tmp_path: Path, model: str) -> None:
    result = run_cli("launch", "--dry-run", "--artifact-path", str(tmp_path / "store"), "--", "vllm", "serve", model)
    assert result.returncode == 2, result.stdout + result.stderr
    assert model in one_line_error(result) and result.stdout == ""


def test_hub_ids_and_existing_paths_still_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for model in ("someorg/somemodel", str(write_checkpoint(tmp_path / "model"))):
        result = run_cli("launch", "--dry-run", "--json", "--artifact-path", str(tmp_path / "store"), "--",
                         "vllm", "serve", model)
        assert result.returncode == 0, result.stderr


@pytest.fixture
def shared_run_dir() -> Iterator[Path]:
    """A --run-dir in a place others can write (0777, no sticky bit: links in it are followed), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="mx41-shared-", dir="/tmp"))
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_another_user_can_neither_read_the_log_nor_plant_its_name(shared_run_dir: Path) -> None:
    intruder = intruder_or_skip()
    log = shared_run_dir / "engine.log"
    with open_log(log) as fh:
        fh.write(b"what the engine printed\n")
    tried = intruder.python(f"open({str(log)!r}).read()", check=False)
    assert tried.returncode != 0 and "PermissionError" in tried.stderr, tried.stdout + tried.stderr
    victim = shared_run_dir.parent / f"{shared_run_dir.name}-victim"
    victim.write_text("the victim's own file")
    try:
        for kind in ("link", "fifo", "file"):
            name = shared_run_dir / f"{kind}.log"
            intruder.python({"link": f"import os; os.symlink({str(victim)!r}, {str(name)!r})",
                             "fifo": f"import os; os.mkfifo({str(name)!r}, 0o666)",
                             "file": f"import os; open({str(name)!r}, 'w').close(); os.chmod({str(name)!r}, 0o666)"}[kind])
            with pytest.raises(ForeignPath):
                open_log(name, append=kind == "file")
        assert victim.read_text() == "the victim's own file"
        assert (shared_run_dir / "file.log").read_bytes() == b""  # nothing written into the intruder's file
    finally:
        victim.unlink()
