"""Hub ids downloaded once per store (remote/): against a real HTTP server that speaks the hub's API
(tests/helpers/hub_server.py), with huggingface_hub itself as the oracle for the cache layout the engines
read, real processes for the concurrent launchers, and the server's own counts for "one download"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.remote import hub
from mxlaunch.remote.fetch import ensure_model
from mxlaunch.remote.ranged import DownloadCancelled
from mxlaunch.store.core import Store
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.hub_server import HubServer
from tests.helpers.tiny_model import cached_model

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10  # the tiny model's ~1 MiB safetensors file is 16 ranged GETs


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Path:
    return cached_model(Path(request.config.cache.mkdir("mxlaunch-tiny-models")))


@pytest.fixture
def server(model: Path):
    with HubServer({"org/tiny": model}) as s:
        yield s


def env_for(server: HubServer, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return {**env, "HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home"), **extra}


def events() -> tuple[list, object]:
    seen: list = []
    return seen, lambda event, **fields: seen.append((event, fields))


def test_a_download_lands_where_huggingface_hub_looks_and_the_next_is_free(server: HubServer, model: Path, tmp_path: Path) -> None:
    cache, store = tmp_path / "hub", Store(tmp_path / "store")
    seen, emit = events()
    got = ensure_model("org/tiny", None, store, emit, cache=cache, environ=env_for(server, cache), chunk=CHUNK)
    assert got.by == "here" and got.bytes == sum(p.stat().st_size for p in model.iterdir() if p.is_file())
    for p in model.iterdir():  # byte for byte, through the snapshot's links
        assert (got.path / p.name).read_bytes() == p.read_bytes()
    weights = (model / "model.safetensors").stat().st_size
    assert server.bytes_served["model.safetensors"] == weights  # no byte fetched twice
    assert server.gets["model.safetensors"] == -(-weights // CHUNK)  # in ranged GETs, in parallel
    # the oracle: huggingface_hub, offline, resolves the hub id to exactly this folder
    oracle = subprocess.run([sys.executable, "-c", "from huggingface_hub import snapshot_download as s; "
                             "print(s('org/tiny', local_files_only=True))"],
                            env=env_for(server, cache), capture_output=True, text=True, timeout=120)
    assert oracle.returncode == 0, oracle.stderr[-2000:]
    assert oracle.stdout.strip() == str(got.path)
    assert [e for e, f in seen if e == "download"] == ["download", "download"]
    again = ensure_model("org/tiny", None, store, emit, cache=cache, environ=env_for(server, cache))
    assert again.by == "cached" and again.path == got.path and server.gets["model.safetensors"] == -(-weights // CHUNK)
    assert not (store.root / ".downloads").exists() or not any((store.root / ".downloads").iterdir())


def test_the_launch_planner_then_finds_the_hub_id(server: HubServer, tmp_path: Path) -> None:
    from mxlaunch.engines.vllm_argv import parse_vllm_argv

    cache = tmp_path / "hub"
    env = env_for(server, cache)
    got = ensure_model("org/tiny", "main", Store(tmp_path / "store"), events()[1], cache=cache, environ=env)
    old = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(cache)
    try:
        spec = parse_vllm_argv(["vllm", "serve", "org/tiny"], engine_version="x")
    finally:
        os.environ.pop("HF_HUB_CACHE") if old is None else os.environ.__setitem__("HF_HUB_CACHE", old)
    assert spec.model_path == str(got.path.resolve()) and spec.safe


def test_a_dropped_connection_is_fetched_again_and_the_file_is_exact(server: HubServer, model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    server.drop_once["model.safetensors"] = 1000  # the first GET of it ends after 1000 bytes
    got = ensure_model("org/tiny", None, Store(tmp_path / "store"), events()[1], cache=cache,
                       environ=env_for(server, cache), chunk=CHUNK)
    assert (got.path / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert server.gets["model.safetensors"] == -(-(model / "model.safetensors").stat().st_size // CHUNK) + 1


def test_an_interrupted_download_resumes_and_is_never_visible_half_written(server: HubServer, model: Path,
                                                                           tmp_path: Path, monkeypatch) -> None:
    import mxlaunch.remote.ranged as ranged

    cache, store = tmp_path / "hub", Store(tmp_path / "store")
    weights = (model / "model.safetensors").stat().st_size
    real, big = ranged._fetch_chunk, [0]

    def stopped_after_four(client, t, i, chunk, fd, progress, cancelled):  # the launcher stops after 4 weight chunks
        if t.size > chunk:
            if big[0] == 4:
                raise DownloadCancelled("the download was stopped", "run it again")
            big[0] += 1
        return real(client, t, i, chunk, fd, progress, cancelled)

    monkeypatch.setattr(ranged, "_fetch_chunk", stopped_after_four)
    with pytest.raises(DownloadCancelled):
        ensure_model("org/tiny", None, store, events()[1], cache=cache, environ=env_for(server, cache), chunk=CHUNK, workers=1)
    monkeypatch.setattr(ranged, "_fetch_chunk", real)
    folder = hub.repo_folder(cache, "org/tiny")
    sha = hub_sha((model / "model.safetensors").read_bytes())
    assert not (folder / "blobs" / sha).exists() and (folder / "blobs" / f"{sha}.incomplete").stat().st_size == weights
    assert not list(folder.glob("snapshots/*/model.safetensors")) and not (folder / "refs" / "main").exists()
    assert server.bytes_served["model.safetensors"] == 4 * CHUNK
    got = ensure_model("org/tiny", None, store, events()[1], cache=cache, environ=env_for(server, cache), chunk=CHUNK)
    assert (got.path / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert server.bytes_served["model.safetensors"] == weights  # the second run fetched only what was missing
    assert not list((folder / "blobs").glob("*.incomplete*"))


def test_a_file_that_arrives_wrong_is_removed_and_nothing_names_it(server: HubServer, model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    server.corrupt.add("model.safetensors")
    with pytest.raises(CheckFailed, match="arrived wrong"):
        ensure_model("org/tiny", None, Store(tmp_path / "store"), events()[1], cache=cache, environ=env_for(server, cache))
    folder = hub.repo_folder(cache, "org/tiny")
    assert not (folder / "blobs" / hub_sha((model / "model.safetensors").read_bytes())).exists()
    assert not list((folder / "blobs").glob("*safetensors*")) and not list(folder.glob("snapshots/*/model.safetensors"))
    assert not list((folder / "blobs").glob(f"{hub_sha((model / 'model.safetensors').read_bytes())}*"))


def hub_sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_three_concurrent_launchers_download_once(server: HubServer, model: Path, tmp_path: Path) -> None:
    """Three `mxlaunch pull` processes at once on one store: the server serves each weight byte once; all
    three end with the same folder; the two that did not download say they waited."""
    cache, store = tmp_path / "hub", tmp_path / "store"
    env = env_for(server, cache)
    procs = [subprocess.Popen([sys.executable, "-m", "mxlaunch.cli", "pull", "org/tiny", "--artifact-path", str(store),
                               "--json", "-j", "2"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    docs = [json.loads(out) for out, _ in results]
    assert len({d["path"] for d in docs}) == 1 and sorted(d["by"] for d in docs).count("here") == 1
    assert server.bytes_served["model.safetensors"] == (model / "model.safetensors").stat().st_size  # once
    assert sorted(d["by"] for d in docs) in (["here", "other", "other"], ["cached", "here", "other"], ["cached", "cached", "here"])


@pytest.mark.parametrize("case", ["no-such-repo", "no-such-revision", "needs-token", "unreachable"])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(server: HubServer, tmp_path: Path, case: str) -> None:
    cache = tmp_path / "hub"
    env = env_for(server, cache)
    args = ["pull", "org/tiny", "--artifact-path", str(tmp_path / "store")]
    if case == "no-such-repo":
        args[1] = "org/nothing"
    elif case == "no-such-revision":
        args += ["--revision", "v9"]
    elif case == "needs-token":
        server.token = "secret"
    else:
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    result = run_cli(*args, env=env)
    line = one_line_error(result)
    assert result.returncode == 2, result.stderr
    expected = {"no-such-repo": "does not exist", "no-such-revision": "revision 'v9'", "needs-token": "HF_TOKEN",
                "unreachable": "cannot reach the model hub"}[case]
    assert expected in line and " — " in line, line
    assert not cache.exists() or not list(cache.rglob("*.incomplete*"))
    if case == "needs-token":  # with the token it goes through
        ok = run_cli(*args, "--json", env={**env, "HF_TOKEN": "secret"})
        assert ok.returncode == 0 and json.loads(ok.stdout)["by"] == "here", ok.stderr


def test_offline_means_no_download(server: HubServer, tmp_path: Path) -> None:
    result = run_cli("pull", "org/tiny", env=env_for(server, tmp_path / "hub", HF_HUB_OFFLINE="1"))
    assert result.returncode == 2 and "HF_HUB_OFFLINE" in one_line_error(result)
    assert sum(server.gets.values()) == 0


def test_a_launch_leaves_what_it_should_to_the_engine(server: HubServer, tmp_path: Path) -> None:
    """download_for_command: a local folder, HF_HUB_OFFLINE, ModelScope and --download-dir ask the hub nothing."""
    from mxlaunch.launch.model_fetch import download_for_command

    cache, store = tmp_path / "hub", Store(tmp_path / "store")
    serve = ["vllm", "serve", "org/tiny"]
    cases = [({}, ["vllm", "serve", str(tmp_path)], None), ({"HF_HUB_OFFLINE": "1"}, serve, "HF_HUB_OFFLINE is set"),
             ({"VLLM_USE_MODELSCOPE": "true"}, serve, "reads models from ModelScope"),
             ({}, [*serve, "--download-dir", str(tmp_path / "d")], "--download-dir names the engine's own cache")]
    for extra, argv, why in cases:
        seen, emit = events()
        assert download_for_command(argv, store, emit, environ=env_for(server, cache, **extra)) is None, argv
        # a hub id left to the engine is said, with why; a local folder is no download at all
        assert [(e, f["status"], why in f["message"]) for e, f in seen] == ([] if why is None else [("download", "off", True)]), seen
    assert server.requests == []
    got = download_for_command(serve, store, events()[1], environ=env_for(server, cache))
    assert got is not None and got.by == "here"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real filesystem of 3 MiB (tmpfs): a full disk without filling the machine's."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_disk_without_room_is_one_line_before_any_byte_and_leaves_nothing(server: HubServer, small_disk: Path,
                                                                           tmp_path: Path) -> None:
    (small_disk / "ballast").write_bytes(b"\0" * (2 << 20))  # 1 MiB left: less than the tiny model
    cache = small_disk / "hub"
    result = run_cli("pull", "org/tiny", "--artifact-path", str(tmp_path / "store"), env=env_for(server, cache))
    line = one_line_error(result)
    assert result.returncode == 1 and "not enough disk space" in line and "HF_HUB_CACHE" in line, result.stderr
    assert not server.bytes_served.get("model.safetensors") and not list(cache.rglob("*.incomplete*"))


def test_a_disk_that_fills_up_mid_download_ends_it_in_one_line_and_frees_its_partial_files(
        server: HubServer, small_disk: Path, tmp_path: Path) -> None:
    """Room at the start; another writer takes it after the first chunk: ENOSPC, named, nothing half-written left."""
    import httpx

    from mxlaunch.remote.ranged import Target, download

    url = f"{server.url}/org/tiny/resolve/main/model.safetensors"
    with httpx.Client() as client:
        size = int(client.head(url, follow_redirects=True).headers["content-length"])
    assert size > 4 * CHUNK and size < (2 << 20), size
    dest = small_disk / "dl" / "model.safetensors"
    filled: list[int] = []

    def progress(n: int) -> None:  # the first bytes in: someone else fills the disk
        if n > 0 and not filled:
            with open(small_disk / "other-writer", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (64 << 10))
                except OSError:
                    filled.append(1)

    with httpx.Client(follow_redirects=True) as client, pytest.raises(CheckFailed) as full:
        download(client, [Target(url, dest, size, lambda p: None)], chunk=CHUNK, workers=1, progress=progress)
    assert filled and "filled up during the download" in str(full.value) and "HF_HUB_CACHE" in full.value.one_line()
    assert not dest.exists() and not list(dest.parent.glob("*.incomplete*"))


def test_each_file_is_renamed_in_as_its_last_chunk_lands_not_when_all_are_done(server: HubServer, tmp_path: Path) -> None:
    """Per-file readiness (S3 staging relies on it): with one connection, the first file is whole and under its
    name while the second has not arrived."""
    import httpx

    from mxlaunch.remote.ranged import Target, download

    urls = [f"{server.url}/org/tiny/resolve/main/{name}" for name in ("model.safetensors", "config.json")]
    with httpx.Client(follow_redirects=True) as client:
        sizes = [int(client.head(u).headers["content-length"]) for u in urls]
        targets = [Target(u, tmp_path / Path(u).name, n, lambda p: None) for u, n in zip(urls, sizes)]
        seen: list[tuple[str, bool, bool]] = []
        download(client, targets, chunk=CHUNK, workers=1,
                 on_file=lambda t: seen.append((t.dest.name, t.dest.is_file(), targets[1].dest.exists())))
    assert seen == [("model.safetensors", True, False), ("config.json", True, True)]


@pytest.mark.parametrize("env", [{"HF_HUB_CACHE": "/a/hub"}, {"HUGGINGFACE_HUB_CACHE": "/b/hub", "HF_HOME": "/h"},
                                 {"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, {"XDG_CACHE_HOME": "/x"}, {}])
def test_the_hub_cache_is_where_huggingface_hub_itself_looks(env: dict[str, str]) -> None:
    """Oracle: the installed huggingface_hub's HF_HUB_CACHE, read in a fresh interpreter with the same variables."""
    from mxlaunch.engines.environment import hub_cache_dir

    names = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
    environ = {**{k: v for k, v in os.environ.items() if k not in names}, **env}
    theirs = subprocess.run([sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
                            env=environ, capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert hub_cache_dir(dict(env)) == Path(theirs)  # (only these variables: no environment in a failure)


def test_launchers_writing_one_ref_and_link_at_once_never_take_each_others_temp_file(tmp_path: Path) -> None:
    """Three `mxlaunch pull`s of one model each write its refs/main and its snapshot links once the files are in;
    with one shared temp name, one's rename took the file from under another's (`FileNotFoundError: ….mx-ref ->
    refs/main`, seen in CI). Threads stand in for the processes: every write lands, and no temp file is left."""
    f = hub.HubFile(path="config.json", size=2, blob="a" * 40, lfs=False)
    rev = hub.HubRevision(endpoint="http://hub", repo="org/tiny", revision="main", commit="c" * 40, files=(f,))
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def writer() -> None:
        go.wait()
        try:
            for _ in range(200):
                hub.write_ref(tmp_path, rev)
                hub.link_file(tmp_path, rev, f)
        except BaseException as exc:  # noqa: BLE001 — the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors[:3]
    repo = hub.repo_folder(tmp_path, rev.repo)
    assert (repo / "refs" / "main").read_text() == rev.commit
    link = hub.snapshot_dir(tmp_path, rev) / "config.json"
    assert os.readlink(link) == os.path.relpath(hub.blob_path(tmp_path, rev.repo, f), link.parent)
    assert not [p for p in repo.rglob(".*") if p.name.endswith((".mx-ref", ".mx-link"))]  # no temp file left


def test_a_link_planted_at_the_refs_temp_name_is_never_written_through(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub cache on a shared filesystem is open to neighbours: were the temp name guessed (here it is made
    fixed), a link planted there must fail the write, not carry the commit into the file it points to."""
    victim = tmp_path / "victim"
    victim.write_text("mine")
    rev = hub.HubRevision(endpoint="http://hub", repo="org/tiny", revision="main", commit="c" * 40, files=())
    refs = hub.repo_folder(tmp_path / "hub", rev.repo) / "refs"
    refs.mkdir(parents=True)
    monkeypatch.setattr(hub, "unique_name", lambda prefix: prefix + "guessed")
    (refs / ".main.guessed.mx-ref").symlink_to(victim)
    with pytest.raises(FileExistsError):
        hub.write_ref(tmp_path / "hub", rev)
    assert victim.read_text() == "mine" and not (refs / "main").exists()
