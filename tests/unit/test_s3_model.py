"""A model given as s3://bucket/path, downloaded once per store (remote/s3.py): against a real S3 server
(moto's server mode in its own process, tests/helpers/s3_server.py), real processes for concurrent
launchers, and the server's own request log for "one download"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch.errors import UsageError
from mxlaunch.remote import s3
from mxlaunch.launch.model_fetch import localize_command
from mxlaunch.store.core import Store
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.s3_server import S3Server, s3_environ
from tests.helpers.tiny_model import cached_model

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
URL = "s3://models/org/tiny"
WEIGHTS = "org/tiny/model.safetensors"


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Path:
    return cached_model(Path(request.config.cache.mkdir("mxlaunch-tiny-models")))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    with S3Server(tmp_path_factory.mktemp("s3")) as srv:
        srv.upload_folder(model, "models", "org/tiny")
        yield srv


def events() -> tuple[list, object]:
    seen: list = []
    return seen, lambda event, **fields: seen.append((event, fields))


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    return names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name != s3.COMPLETE) \
        and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_a_download_lands_in_the_store_checked_and_the_next_is_free(server: S3Server, model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    seen, emit = events()
    before = server.gets(WEIGHTS)
    got = s3.ensure_model(URL, store, emit, environ=s3_environ(server), chunk=256 << 10)
    assert got.by == "here" and got.bytes == sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    assert same_files(model, got.path) and (got.path / s3.COMPLETE).is_file()
    assert got.path.is_relative_to(store.root / ".models" / "s3" / "models" / "org" / "tiny")
    size = (model / "model.safetensors").stat().st_size
    assert server.gets(WEIGHTS) - before == -(-size // (256 << 10))  # one ranged GET per chunk, each once
    start = next(f for e, f in seen if e == "download" and f.get("status") == "start")
    assert "checked by size only" not in start["message"]  # moto's single-part ETags are MD5s: every file hashed
    assert not list(got.path.rglob("*.incomplete*"))
    assert store.list() == []  # the downloaded folder is no snapshot (store list and prune skip it)
    again = s3.ensure_model(URL, store, emit, environ=s3_environ(server))
    assert again.by == "cached" and again.path == got.path and server.gets(WEIGHTS) - before == -(-size // (256 << 10))


def test_a_changed_object_is_a_new_folder_never_a_file_swapped_under_the_old_one(server: S3Server, model: Path,
                                                                                 tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    _, emit = events()
    server.upload_folder(model, "models", "org/changing")
    first = s3.ensure_model("s3://models/org/changing", store, emit, environ=s3_environ(server))
    server.client().put_object(Bucket="models", Key="org/changing/tokenizer_config.json", Body=b'{"changed": true}')
    second = s3.ensure_model("s3://models/org/changing", store, emit, environ=s3_environ(server))
    assert second.path != first.path and second.commit != first.commit and second.by == "here"
    assert (first.path / "tokenizer_config.json").read_bytes() != b'{"changed": true}'
    assert (second.path / "tokenizer_config.json").read_bytes() == b'{"changed": true}'


def test_three_concurrent_launchers_download_once(server: S3Server, model: Path, tmp_path: Path) -> None:
    """Three `mxlaunch pull` processes at once on one store: the server logs each weight chunk's GET once."""
    store = tmp_path / "store"
    before = server.gets(WEIGHTS)
    procs = [subprocess.Popen([sys.executable, "-m", "mxlaunch.cli", "pull", URL, "--artifact-path", str(store),
                               "--json", "-j", "2"], env=s3_environ(server), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    docs = [json.loads(out) for out, _ in results]
    assert len({d["path"] for d in docs}) == 1 and sorted(d["by"] for d in docs).count("here") == 1, docs
    size = (model / "model.safetensors").stat().st_size
    assert server.gets(WEIGHTS) - before == -(-size // (16 << 20))  # the default chunk: one download's GETs
    assert same_files(model, Path(docs[0]["path"]))


@pytest.mark.parametrize("case", ["no-such-bucket", "no-such-path", "not-a-model-folder", "no-credentials", "bad-url",
                                  "unreachable"])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(server: S3Server, tmp_path: Path, case: str) -> None:
    env = s3_environ(server)
    url = {"no-such-bucket": "s3://nobucket/org/tiny", "no-such-path": "s3://models/org/none",
           "not-a-model-folder": "s3://models/org", "bad-url": "s3://models"}.get(case, URL)
    if case == "no-credentials":
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    if case == "unreachable":
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    result = run_cli("pull", url, "--artifact-path", str(tmp_path / "store"), env=env)
    line = one_line_error(result)
    assert result.returncode == 2, result.stderr
    expected = {"no-such-bucket": "does not exist", "no-such-path": "no objects below", "not-a-model-folder": "config.json",
                "no-credentials": "AWS_ACCESS_KEY_ID", "bad-url": "s3://bucket/path", "unreachable": "AWS_ENDPOINT_URL"}[case]
    assert expected in line and " — " in line, line
    assert not (tmp_path / "store" / ".models").exists()


def test_the_command_names_the_local_folder_and_keeps_the_served_name(server: S3Server, tmp_path: Path) -> None:
    """localize_command: the engine gets the store's folder; its API still answers to the S3 name. The
    runai_streamer load format reads S3 itself: left alone."""
    store = Store(tmp_path / "store")
    seen, emit = events()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", URL, "--dtype", "float32"]
    local = localize_command(argv, store, emit, environ=s3_environ(server))
    folder = next(f["dir"] for e, f in seen if e == "model")
    assert local[local.index("--model") + 1] == folder and local[-2:] == ["--served-model-name", URL]
    assert URL not in local[:-1]
    named = localize_command([*argv, "--served-model-name", "tiny"], store, emit, environ=s3_environ(server))
    assert named.count("--served-model-name") == 1 and named[-1] == "tiny"
    sg = ["python", "-m", "sglang.launch_server", f"--model-path={URL}"]
    assert localize_command(sg, store, emit, environ=s3_environ(server))[3] == f"--model-path={folder}"
    streamed = [*argv, "--load-format", "runai_streamer"]
    assert localize_command(streamed, store, emit, environ=s3_environ(server)) == streamed


def test_a_dry_run_says_the_model_is_downloaded_before_planning(tmp_path: Path) -> None:
    result = run_cli("launch", "--dry-run", "--artifact-path", str(tmp_path / "store"), "--",
                     sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", URL)
    assert result.returncode == 0, result.stderr
    assert "is in S3" in result.stdout and "mxlaunch pull" in result.stdout


def test_s3_urls_parse_or_say_what_is_wrong() -> None:
    assert s3.parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    for bad in ("s3://", "s3://b", "s3://Bad_Bucket/x", "s3://bucket/a/../b", "http://x/y"):
        with pytest.raises(UsageError):
            s3.parse_url(bad)
