"""The artifact store: atomic, exactly-once publish (real processes), refusals of damaged snapshots, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mxlaunch.coord.file import FileCoordinator
from mxlaunch.coord.file import write_json_atomic
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.store.core import MANIFEST, SnapshotMeta, Store, default_root, xxh3_file

from tests.helpers.cli import REPO, one_line_error, run_cli

SID = "feedc0de12345678"
META = SnapshotMeta(engine="vllm", engine_version="0.32.0", spec={"model": "/models/tiny", "tp": 2, "pp": 1},
                    identity={"model": "/models/tiny", "tp": 2})


def write_rank(writer, rank: int, size: int = 4096) -> None:
    d = writer.rank_dir(rank)
    (d / "part-00000.safetensors").write_bytes(bytes((rank + i) % 251 for i in range(size)))
    (d / "part-00001.safetensors").write_bytes(b"\x07" * (size // 2 + rank))
    (d / "meta.json").write_text(json.dumps({"rank": rank}))
    writer.add_rank_dir(rank)


def capture(store: Store, sid: str = SID, nranks: int = 2) -> Path:
    with store.begin_capture(sid, META, nranks=nranks) as writer:
        for r in range(nranks):
            write_rank(writer, r)
        assert writer.mark_node_done() is True
    return store.root / sid


def edit_manifest(folder: Path, change) -> None:
    data = json.loads((folder / MANIFEST).read_text())
    change(data)
    (folder / MANIFEST).write_text(json.dumps(data))


def first_file(folder: Path, rank: int = 0, suffix: str = ".safetensors") -> Path:
    data = json.loads((folder / MANIFEST).read_text())
    rel = next(f["path"] for f in data["ranks"][rank]["files"] if f["path"].endswith(suffix))
    return folder / rel


# ---- capture and lookup ----------------------------------------------------------------------------------


def test_capture_lookup_verify_roundtrip(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    snap, why = store.lookup(SID)
    assert snap is not None and why == ""
    m = snap.manifest
    assert m["schema"] == 1 and m["source_id"] == SID and m["nranks"] == 2 and m["engine"] == "vllm"
    assert m["engine_version"] == "0.32.0" and m["spec"]["tp"] == 2 and m["identity"] == META.identity
    assert m["snapshot"] == {"format": "mxlaunch-raw", "version": 1}
    assert m["created_at"].endswith("Z") and m["created_by"]["mxlaunch"]
    files = snap.files_for_ranks([1])
    assert len(files) == 3 and all(p.is_file() and p.stat().st_size == n and xxh3_file(p) == h for p, n, h in files)
    assert all("/ranks/1/" in str(p) for p, _, _ in files)
    assert store.verify(SID).ok
    # nothing but the manifest and the data folder is left (no temp folders, no node markers)
    assert sorted(p.name for p in folder.iterdir()) == sorted([MANIFEST, f"data-{m['capture_id']}"])
    with pytest.raises(UsageError):
        snap.files_for_ranks([2])


def test_no_manifest_until_every_rank_is_written(tmp_path: Path) -> None:
    store = Store(tmp_path)
    writers = [store.begin_capture(SID, META, nranks=4, nnodes=2, node_rank=n, capture_id="cap1") for n in (0, 1)]
    assert writers[1].ranks == [2, 3]
    write_rank(writers[0], 0)
    write_rank(writers[0], 1)
    assert writers[0].mark_node_done() is False  # node 1 is still writing
    assert not (store.root / SID / MANIFEST).exists()
    snap, why = store.lookup(SID)
    assert snap is None and "no manifest" in why
    write_rank(writers[1], 2)
    with pytest.raises(CheckFailed, match="rank 3 has no files"):
        writers[1].mark_node_done()
    assert not (store.root / SID / MANIFEST).exists()
    write_rank(writers[1], 3)
    assert writers[1].mark_node_done() is True
    snap, _ = store.lookup(SID)
    assert snap is not None and [r["rank"] for r in snap.manifest["ranks"]] == [0, 1, 2, 3]


def test_aborted_capture_leaves_nothing_visible(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.begin_capture(SID, META, nranks=1) as writer:
            write_rank(writer, 0)
            raise RuntimeError("engine died")
    assert list((store.root / SID).iterdir()) == []
    assert store.lookup(SID).snapshot is None


def test_writer_refuses_bad_files(tmp_path: Path) -> None:
    store = Store(tmp_path)
    writer = store.begin_capture(SID, META, nranks=2)
    d = writer.rank_dir(0)
    (d / "weights.pt").write_bytes(b"pickle")
    with pytest.raises(UsageError, match="not a .safetensors or .json"):
        writer.add_file(0, "weights.pt")
    with pytest.raises(UsageError):
        writer.add_file(0, "../escape.safetensors")
    with pytest.raises(CheckFailed):
        writer.add_file(0, "missing.safetensors")
    with pytest.raises(UsageError):
        writer.rank_dir(5)
    assert writer.add_rank_dir(0) == []  # the .pt file is never recorded
    writer.abort()
    capture(store)
    with pytest.raises(CheckFailed, match="already published"):
        store.begin_capture(SID, META, nranks=2)


def test_losing_capture_cleans_its_files(tmp_path: Path) -> None:
    store = Store(tmp_path)
    a = store.begin_capture(SID, META, nranks=1, capture_id="a")
    b = store.begin_capture(SID, META, nranks=1, capture_id="b")
    write_rank(a, 0)
    write_rank(b, 0)
    assert a.mark_node_done() is True
    assert b.mark_node_done() is False
    assert sorted(p.name for p in (store.root / SID).iterdir()) == ["data-a", MANIFEST]
    assert store.verify(SID).ok


def test_files_and_folders_are_not_world_writable(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        folder = capture(Store(tmp_path / "store"))
    finally:
        os.umask(old)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in filenames)]:
            assert not os.stat(name).st_mode & stat.S_IWOTH, name


def test_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MXLAUNCH_ARTIFACT_PATH", str(tmp_path / "a"))
    assert default_root() == tmp_path / "a"
    monkeypatch.delenv("MXLAUNCH_ARTIFACT_PATH")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_root() == tmp_path / "cache" / "mxlaunch" / "store"


# ---- refusals ----------------------------------------------------------------------------------------------


def test_flipped_byte_passes_quick_lookup_but_fails_verify(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    victim = first_file(folder, 1)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert store.lookup(SID).snapshot is not None  # sizes only
    report = store.verify(SID, full=True)
    assert not report.ok and len(report.problems) == 1
    assert victim.name in report.problems[0] and "checksum" in report.problems[0]
    assert store.verify(SID, full=False).ok


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    victim = first_file(folder, 0)
    os.truncate(victim, victim.stat().st_size - 1)
    snap, why = store.lookup(SID)
    assert snap is None and victim.name in why and "bytes" in why and "\n" not in why


def test_missing_file_and_missing_manifest_are_refused(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    victim = first_file(folder, 1, ".json")
    victim.unlink()
    snap, why = store.lookup(SID)
    assert snap is None and "missing" in why and victim.name in why
    (folder / MANIFEST).unlink()
    snap, why = store.lookup(SID)
    assert snap is None and "no manifest" in why
    snap, why = store.lookup("0000000000000000")
    assert snap is None and "no snapshot" in why
    snap, why = store.lookup("../etc")
    assert snap is None and "not a valid source id" in why


@pytest.mark.parametrize(
    "change, expect",
    [
        (lambda m: m["ranks"][0]["files"][0].update(path="../../../etc/passwd.json"), "leaves the snapshot folder"),
        (lambda m: m["ranks"][0]["files"][0].update(path="data-x/./a.safetensors"), "leaves the snapshot folder"),
        (lambda m: m["ranks"][0]["files"][0].update(path="/etc/hosts.json"), "absolute"),
        (lambda m: m["ranks"][0]["files"][0].update(path="data-x/ranks/0/model.pt"), "not a .safetensors or .json"),
        (lambda m: m["ranks"][0]["files"][0].update(path="data-x/ranks/0/model.bin"), "not a .safetensors or .json"),
        (lambda m: m["ranks"][0]["files"][0].update(xxh3_128="zz"), "xxh3_128"),
        (lambda m: m["ranks"][0]["files"][0].update(bytes=-1), "byte count"),
        (lambda m: m.update(schema=2), "schema 2"),
        (lambda m: m.update(source_id="other"), "is for source id"),
        (lambda m: m["ranks"].pop(), "rank 1 is missing"),
        (lambda m: m["ranks"].append(m["ranks"][0]), "twice"),
        (lambda m: m.update(nranks="2"), "nranks"),
        (lambda m: m["ranks"][0].update(files=[]), "no files"),
    ],
)
def test_bad_manifests_are_refused(tmp_path: Path, change, expect: str) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    edit_manifest(folder, change)
    snap, why = store.lookup(SID)
    assert snap is None and expect in why and "\n" not in why, why
    assert not store.verify(SID).ok


def test_unparsable_manifest_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    (folder / MANIFEST).write_text('{"schema": 1, "ranks": [')
    snap, why = store.lookup(SID)
    assert snap is None and "not valid JSON" in why
    (folder / MANIFEST).write_bytes(b"\xff\xfe")
    assert store.lookup(SID).snapshot is None
    (folder / MANIFEST).write_text("[]")
    assert "not a JSON object" in store.lookup(SID).reason


def test_symlink_escaping_the_store_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    folder = capture(store)
    victim = first_file(folder, 0)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(victim, outside)
    victim.unlink()
    victim.symlink_to(outside)
    snap, why = store.lookup(SID)
    assert snap is None and "outside the store" in why
    # a symlinked snapshot folder leaves the store too
    other = tmp_path / "elsewhere"
    shutil.copytree(folder, other, symlinks=True)
    (tmp_path / "store" / "1111222233334444").symlink_to(other)
    edit_manifest(other, lambda m: m.update(source_id="1111222233334444"))
    assert store.lookup("1111222233334444").snapshot is None
    # a symlink to a non-safetensors file inside the store is refused by name
    capture(store, "5555666677778888")
    f2 = first_file(store.root / "5555666677778888")
    (f2.parent / "evil.pkl").write_bytes(f2.read_bytes())
    f2.unlink()
    f2.symlink_to(f2.parent / "evil.pkl")
    assert "not a .safetensors or .json" in store.lookup("5555666677778888").reason


# ---- exactly-once publish with real processes ---------------------------------------------------------------

# Both racer scripts widen every race window: a random pause before each link/rename, so a publish that is
# not exclusive (check-then-rename, say) double-publishes here almost surely, even on two cores.
WIDEN = r"""
import os, random, time
_link, _replace, _rename = os.link, os.replace, os.rename
def _slow(fn):
    def wrapped(*a, **k):
        time.sleep(random.random() * 0.002)
        return fn(*a, **k)
    return wrapped
os.link, os.replace, os.rename = _slow(_link), _slow(_replace), _slow(_rename)
"""

NODE = WIDEN + r"""
import json, os, sys
from mxlaunch.store.core import SnapshotMeta, Store
root, node, nnodes, rounds, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
store = Store(root)
meta = SnapshotMeta(engine="vllm", spec={"tp": nnodes})
writers = []
for i in range(rounds):
    w = store.begin_capture(f"race{i:04d}", meta, nranks=nnodes * 2, nnodes=nnodes, node_rank=node, capture_id="c")
    for r in w.ranks:
        (w.rank_dir(r) / "part.safetensors").write_bytes(bytes([r]) * (100 + r))
        w.add_file(r, "part.safetensors")
    writers.append(w)
print("ready", flush=True)
while not os.path.exists(go):
    pass
print(json.dumps([i for i, w in enumerate(writers) if w.mark_node_done()]), flush=True)
"""


def test_nodes_finishing_together_publish_exactly_once(tmp_path: Path) -> None:
    nnodes, rounds = 4, 60
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", NODE, str(tmp_path), str(n), str(nnodes), str(rounds), str(go)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO) for n in range(nnodes)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    published = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        assert p.wait(timeout=30) == 0
    flat = sorted(i for w in published for i in w)
    assert flat == list(range(rounds)), f"published twice or never: {flat}"
    store = Store(tmp_path)
    for i in range(rounds):
        report = store.verify(f"race{i:04d}")
        assert report.ok and report.files == nnodes * 2, report
        assert sorted(p.name for p in (tmp_path / f"race{i:04d}").iterdir()) == ["data-c", MANIFEST]


PUBLISH = WIDEN + r"""
import os, sys
from mxlaunch.coord.file import write_json_atomic
go = sys.argv[2]
while not os.path.exists(go):
    pass
won = [i for i in range(int(sys.argv[3])) if write_json_atomic(f"{sys.argv[1]}/m{i}.json", {"by": os.getpid()}, exclusive=True)]
print(len(won))
"""


def test_exclusive_write_has_one_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    go, n = tmp_path / "go", 100
    procs = [subprocess.Popen([sys.executable, "-c", PUBLISH, str(tmp_path), str(go), str(n)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO) for _ in range(4)]
    time.sleep(0.5)
    go.touch()
    assert sum(int(p.communicate(timeout=30)[0]) for p in procs) == n
    assert not [x for x in os.listdir(tmp_path) if x.endswith(".tmp")]
    # a filesystem without hard links: an O_EXCL lock file decides instead
    def no_link(*_a, **_k):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    assert write_json_atomic(tmp_path / "x.json", {"a": 1}, exclusive=True) is True
    assert write_json_atomic(tmp_path / "x.json", {"a": 2}, exclusive=True) is False
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}


# ---- list / rm and the CLI ---------------------------------------------------------------------------------


def test_list_statuses(tmp_path: Path) -> None:
    store = Store(tmp_path)
    capture(store, "aaaa000000000000")
    store.begin_capture("bbbb000000000000", META, nranks=1)  # never finished
    claim = FileCoordinator(tmp_path).try_claim("cccc000000000000")
    store.begin_capture("cccc000000000000", META, nranks=1)
    folder = capture(store, "dddd000000000000")
    os.truncate(first_file(folder), 1)
    statuses = {e.source_id: e.status for e in store.list()}
    assert statuses == {"aaaa000000000000": "ok", "bbbb000000000000": "incomplete",
                        "cccc000000000000": "claimed", "dddd000000000000": "refused"}
    claim.release()
    assert Store(tmp_path / "nothing-here").list() == []


def test_remove_refuses_while_claimed(tmp_path: Path) -> None:
    store = Store(tmp_path)
    capture(store)
    claim = FileCoordinator(tmp_path).try_claim(SID)
    with pytest.raises(CheckFailed, match="claimed"):
        store.remove(SID)
    store.remove(SID, force=True)
    assert not (tmp_path / SID).exists()
    claim.release()
    with pytest.raises(UsageError):
        store.remove(SID)


def test_cli_list_verify_rm(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store)
    capture(store, "9999000000000000")
    r = run_cli("store", "list", "--artifact-path", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["schema"] == 1 and {s["source_id"]: s["status"] for s in data["snapshots"]} == {
        SID: "ok", "9999000000000000": "ok"}
    row = data["snapshots"][1]
    assert row["model"] == "/models/tiny" and row["tp"] == 2 and row["nranks"] == 2 and row["engine"] == "vllm"
    r = run_cli("store", "list", "--artifact-path", str(tmp_path))
    assert r.returncode == 0 and SID in r.stdout and "ok" in r.stdout

    r = run_cli("store", "verify", SID, "--artifact-path", str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True and json.loads(r.stdout)["schema"] == 1
    victim = first_file(folder, 1)
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = run_cli("store", "verify", SID, "--artifact-path", str(tmp_path))
    assert r.returncode == 1
    line = one_line_error(r)
    assert victim.name in line and "store rm" in line
    r = run_cli("store", "verify", SID, "--artifact-path", str(tmp_path), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False

    r = run_cli("store", "verify", "0000000000000000", "--artifact-path", str(tmp_path))
    assert r.returncode == 2 and "no snapshot" in one_line_error(r)
    r = run_cli("store", "rm", "0000000000000000", "--artifact-path", str(tmp_path))
    assert r.returncode == 2 and "no snapshot" in one_line_error(r)
    r = run_cli("store", "rm", "../..", "--artifact-path", str(tmp_path))
    assert r.returncode == 2 and "not a valid source id" in one_line_error(r)

    claim = FileCoordinator(tmp_path).try_claim(SID)
    r = run_cli("store", "rm", SID, "--artifact-path", str(tmp_path))
    assert r.returncode == 1 and "--force" in one_line_error(r)
    claim.release()
    r = run_cli("store", "rm", SID, "--artifact-path", str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"schema": 1, "removed": SID, "root": str(tmp_path)}
    assert not (tmp_path / SID).exists()

    a_file = tmp_path / "file"
    a_file.write_text("x")
    r = run_cli("store", "list", "--artifact-path", str(a_file))
    assert r.returncode == 2 and "not a folder" in one_line_error(r)


def test_cli_list_is_readable_at_80_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.store.core import model_name

    capture(Store(tmp_path))
    monkeypatch.setenv("COLUMNS", "80")
    r = run_cli("store", "list", "--artifact-path", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if line.startswith(SID))
    assert " tiny " in row and f" vllm {META.engine_version} " in row  # the model by name, the engine with its version
    assert model_name("~/.cache/huggingface/hub/models--org--m-7B/snapshots/0123abcd") == "org/m-7B"
    assert model_name("org/m-7B") == "org/m-7B" and model_name("./ckpt/m/") == "m"
