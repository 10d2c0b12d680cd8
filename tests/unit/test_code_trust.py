"""Code from the store comes only from trusted writers (docs/security.md, mxlaunch/safety/trust.py): a real second user
(tests/helpers/second_user.py) plants kernel-cache archives and zygote images in a group store and default cache
folders in a shared TMPDIR; the victim (this process) refuses each with one event and the engine never gets it,
while an archive of a writer named in MXLAUNCH_TRUSTED_WRITERS is restored. Real files, real uids."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.coord.file import FileCoordinator
from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.errors import UsageError
from mxlaunch.kernelcache import caches
from mxlaunch.kernelcache.archive import KEY_JSON, KernelCacheStore
from mxlaunch.kernelcache.caches import cache_key, key_fields
from mxlaunch.launch import kernel
from mxlaunch.warmstart import zygote_image
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.zygote_starts import ZygoteStarts
from tests.helpers.second_user import SHARED_GROUP, User, ensure_group, intruder  # noqa: F401 — the fixture

pytestmark = pytest.mark.unit
PY = sys.executable
ARGV = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
CAP = 1 << 20


@dataclass
class Shared:
    base: Path  # a folder every user reaches (under /tmp)
    store: Path  # a group store: 2770, group SHARED_GROUP, the intruder a member
    gid: int
    intruder: User

    def plant(self, code: str) -> str:
        """Run code as the intruder, with the shared group; returns its stdout."""
        return self.intruder.python(code, groups=[self.gid]).stdout


@pytest.fixture
def shared(intruder: User, monkeypatch: pytest.MonkeyPatch) -> Iterator[Shared]:  # noqa: F811
    gid = ensure_group(SHARED_GROUP, members=[intruder.name])
    base = Path(tempfile.mkdtemp(prefix="mxl-trust-", dir="/tmp"))
    os.chmod(base, 0o755)
    store = base / "store"
    store.mkdir()
    os.chown(store, -1, gid)
    os.chmod(store, 0o2770)
    monkeypatch.setenv("MXLAUNCH_GROUP", SHARED_GROUP)  # the victim shares the store with the group's members
    monkeypatch.delenv("MXLAUNCH_TRUSTED_WRITERS", raising=False)
    try:
        yield Shared(base, store, gid, intruder)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def fields() -> dict:
    spec = parse_vllm_argv(ARGV, engine_version="0.32.0")
    return key_fields(spec, source_id="a" * 16, device_type="cpu", argv=ARGV,
                      versions={"torch": "2.13.0+cpu", "triton": "3.9.0"},
                      accel={"device": "cpu", "machine": "x86_64", "isa": ["avx2"]}, environ={})


def kc(store: Path) -> KernelCacheStore:
    return KernelCacheStore(store, FileCoordinator(store))


def cache_tree(root: Path) -> Path:
    (root / "triton").mkdir(parents=True)
    (root / "triton" / "good.so").write_bytes(b"the victim's own launcher")
    return root


PLANT_ARCHIVE = '''
import hashlib, io, json, os, tarfile
folder = os.path.join({store!r}, "kernel-cache", {key!r})
os.makedirs(folder, exist_ok=True)
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:") as tar:
    data = b"the intruder's launcher"
    info = tarfile.TarInfo("triton/evil.so")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
blob = buf.getvalue()
name = "cache-20260101000000-ev1l.tar"
with open(os.path.join(folder, name), "wb") as f:
    f.write(blob)
meta = {{"schema": 1, "key": {key!r}, "fields": json.loads({fields!r}), "archive": name, "archive_bytes": len(blob),
        "archive_sha256": hashlib.sha256(blob).hexdigest(), "files": 1, "bytes": len(data), "model": "/m"}}
tmp = os.path.join(folder, ".planted.tmp")
with open(tmp, "w") as f:
    json.dump(meta, f)
os.replace(tmp, os.path.join(folder, "key.json"))  # over the victim's record, where there is one
'''


def plant_archive(shared: Shared, key: str, f: dict) -> None:
    shared.plant(PLANT_ARCHIVE.format(store=str(shared.store), key=key, fields=json.dumps(f)))


def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The victim's node: a node-local cache root and HOME of its own, no cache variable set, quick settling."""
    monkeypatch.setattr(kernel, "POLL_S", 0.1)
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "DG_JIT_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)


def plan(shared: Shared) -> dict:
    return kernel.plan_kernel_cache(parse_vllm_argv(ARGV, engine_version="0.32.0"), source_id="a" * 16,
                                    device_type="cpu", kc_store=kc(shared.store))


def launch(shared: Shared) -> tuple[kernel.KernelCacheRun, list, dict, Path]:
    """A launch's kernel-cache restore on the shared store: (run, events, the engine's variables, the key's folder)."""
    store = kc(shared.store)
    events: list[tuple[str, dict]] = []
    info = plan(shared)
    run = kernel.KernelCacheRun(info, store, lambda e, **kw: events.append((e, kw)), model="/m")
    return run, events, run.restore(), Path(info["dir"])


def planted_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("evil*")] if folder.exists() else []


# ---- kernel-cache archives ----------------------------------------------------------------------------------


def test_an_archive_the_intruder_planted_under_the_victims_key_is_refused(shared: Shared, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    node(tmp_path, monkeypatch)
    info = plan(shared)
    f, key = info["fields"], info["key"]  # this node's key: the intruder computes the same (key.json shows it)
    plant_archive(shared, key, f)
    assert os.stat(shared.store / "kernel-cache" / key / KEY_JSON).st_uid == shared.intruder.uid
    run, events, env, folder = launch(shared)
    run.stop()
    [(name, ev)] = events  # one event, with the reason
    assert name == "kernel-cache" and ev["status"] == "miss" and ev["refused"] is True, ev
    assert "mxl-intruder" in ev["reason"] and "not a trusted writer" in ev["reason"], ev["reason"]
    assert planted_files(folder) == []  # the engine never gets it
    # the victim's capture does not write into the folder the intruder made (it could never be restored)
    captured = kc(shared.store).capture(key, f, cache_tree(tmp_path / "n1"), CAP)
    assert not captured.published and "not captured" in captured.reason and "mxl-intruder" in captured.reason


def test_the_intruder_cannot_replace_or_rewrite_the_victims_archive_in_a_group_store(shared: Shared, tmp_path: Path) -> None:
    f = fields()
    key = cache_key(f)
    store = kc(shared.store)
    assert store.capture(key, f, cache_tree(tmp_path / "n1"), CAP).published
    folder = shared.store / "kernel-cache" / key
    meta = json.loads((folder / KEY_JSON).read_text())
    # rewriting the victim's own archive or record in place: not writable by the group
    out = shared.plant(f'''
import os
for name in ({meta["archive"]!r}, "key.json"):
    try:
        os.open(os.path.join({str(folder)!r}, name), os.O_WRONLY)
        print("wrote", name)
    except PermissionError:
        print("denied", name)
''')
    assert out.split() == ["denied", meta["archive"], "denied", "key.json"], out
    # replacing them by rename (the folder is the group's to write): refused at restore
    plant_archive(shared, key, f)
    result = kc(shared.store).restore(key, tmp_path / "node2", CAP)
    assert result.status == "miss" and result.refused and "mxl-intruder" in result.reason, result
    assert planted_files(tmp_path / "node2") == []


def test_a_tampered_archive_of_the_victims_own_is_refused_before_a_member_is_read(tmp_path: Path) -> None:
    f = fields()
    key = cache_key(f)
    store = kc(tmp_path / "store")
    assert store.capture(key, f, cache_tree(tmp_path / "n1"), CAP).published
    folder = tmp_path / "store" / "kernel-cache" / key
    archive = folder / json.loads((folder / KEY_JSON).read_text())["archive"]
    data = archive.read_bytes()
    at = data.index(b"the victim's own launcher")
    archive.write_bytes(data[:at] + b"THE" + data[at + 3:])  # same size, same headers: a valid tar
    result = store.restore(key, tmp_path / "node2", CAP)
    assert result.status == "miss" and result.refused, result
    assert "not the one its writer recorded" in result.reason and "\n" not in result.reason
    assert not (tmp_path / "node2").exists()  # refused before anything was written


@pytest.mark.parametrize("writers", ["mxl-intruder", f"%{SHARED_GROUP}"])
def test_an_archive_from_a_trusted_writer_is_restored(shared: Shared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      writers: str) -> None:
    f = fields()
    key = cache_key(f)
    plant_archive(shared, key, f)
    monkeypatch.setenv("MXLAUNCH_TRUSTED_WRITERS", writers)
    result = kc(shared.store).restore(key, tmp_path / "node2", CAP)
    assert result.status == "hit" and not result.refused, result
    assert (tmp_path / "node2" / "triton" / "evil.so").read_bytes() == b"the intruder's launcher"


def test_a_trusted_writer_that_is_no_user_stops_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXLAUNCH_TRUSTED_WRITERS", "root, no-such-user-mxl")
    with pytest.raises(UsageError, match="names 'no-such-user-mxl', which is no user on this host"):
        kc(tmp_path / "store")


# ---- seeding from the node's default cache folders --------------------------------------------------------


def test_a_default_cache_folder_another_user_made_first_is_not_seeded(shared: Shared, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tmpdir = shared.base / "tmp"  # a shared /tmp: anyone may create a name first
    tmpdir.mkdir()
    os.chmod(tmpdir, 0o1777)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    inductor = caches.inductor_default_dir()
    triton_elsewhere = tmpdir / "intruders-triton"
    shared.plant(f'''
import os
for d in ({str(inductor / "fx")!r}, {str(inductor / "precompiled_headers")!r}, {str(triton_elsewhere / "ab")!r}):
    os.makedirs(d, mode=0o777)
    os.chmod(d, 0o777)
os.chmod({str(inductor)!r}, 0o755)
open({str(inductor / "fx" / "evil_graph.py")!r}, "w").write("import os  # the intruder's code")
open({str(triton_elsewhere / "ab" / "evil.cubin")!r}, "w").write("x")
''')
    node(tmp_path, monkeypatch)
    home = tmp_path / "home"
    (home / ".triton").mkdir(parents=True)
    (home / ".triton" / "cache").symlink_to(triton_elsewhere)  # a default folder that is a link: never followed
    (home / ".cache" / "vllm" / "deep_gemm" / "kernel").mkdir(parents=True)  # the victim's own DeepGEMM cache
    (home / ".cache" / "vllm" / "deep_gemm" / "kernel" / "kernel.so").write_bytes(b"dg")
    (home / ".cache" / "flashinfer").mkdir(parents=True)
    (home / ".cache" / "flashinfer" / "shared.so").write_bytes(b"fi")
    os.chmod(home / ".cache" / "flashinfer", 0o777)  # the victim's, but anyone could have written into it
    run, events, env, folder = launch(shared)
    [(name, ev)] = events
    assert ev["seeded_files"] == 1, ev  # DeepGEMM's, into the folder DG_JIT_CACHE_DIR names (issue 40)
    assert Path(env["DG_JIT_CACHE_DIR"], "kernel", "kernel.so").read_bytes() == b"dg"
    assert not (folder / "vllm" / "deep_gemm").exists()
    assert planted_files(folder) == [] and not list(folder.rglob("shared.so"))
    assert "torchinductor_" in ev["reason"] and "belongs to uid" in ev["reason"], ev["reason"]
    assert "writable by other users" in ev["reason"] and "a link" in ev["reason"], ev["reason"]
    # Inductor's header folder there is the intruder's: a header written there during the run is not captured
    assert caches.side_dirs() == {}
    shared.plant(f'open({str(inductor / "precompiled_headers" / "evil.h.gch")!r}, "w").write("x")')
    Path(env["TRITON_CACHE_DIR"], "k.bin").write_bytes(b"kernel")
    run.start_capture()
    run.finish(budget_s=60)  # the engine is gone: captured at once
    [captured] = [kw for e, kw in events if e == "kernel-cache-capture"]
    assert captured["published"], captured
    archive = next((shared.store / "kernel-cache").glob("*/cache-*.tar"))
    with tarfile.open(archive) as tar:
        names = [m.name for m in tar if m.isfile()]
    assert not [n for n in names if "evil" in n or "inductor_pch" in n], names


def test_only_own_files_in_own_folders_are_taken_from_a_default_place(shared: Shared, tmp_path: Path) -> None:
    """Inside a folder of the victim's, a sub-folder the intruder could write is left out with what is in it."""
    place = shared.base / "place"
    (place / "mine").mkdir(parents=True)
    (place / "mine" / "a.so").write_bytes(b"a")
    (place / "open").mkdir()
    os.chmod(place / "open", 0o777)
    shared.plant(f'open({str(place / "open" / "evil.so")!r}, "w").write("x")')
    (place / "open" / "exposed.so").write_bytes(b"the victim's, where anyone could have swapped it")
    (place / "mine" / "b.so").symlink_to(place / "open" / "evil.so")
    state, why = caches.own_state(place)
    assert why == "" and sorted(state) == ["mine/a.so"], state
    assert caches.sync_tree(place, tmp_path / "dst", own=True) == 1 and planted_files(tmp_path / "dst") == []


# ---- zygote images --------------------------------------------------------------------------------------------


def test_a_zygote_image_the_intruder_planted_is_refused(shared: Shared, tmp_path: Path) -> None:
    root = zygote_image.images_root(shared.store)  # zygote-images/<the victim's uid>, made by the intruder first
    shared.plant(f'''
import json, os
os.makedirs({str(root / "k1")!r}, mode=0o700)
os.chmod({str(root)!r}, 0o700)
open({str(root / "k1" / "pages-1.img")!r}, "wb").write(b"the intruder's memory")
json.dump({{"pid": 999999}}, open({str(root / "k1" / zygote_image.META)!r}, "w"))
''')
    folder, why = zygote_image.check_image(shared.store, "k1")
    assert folder is None and f"uid {shared.intruder.uid}" in why and "not a folder of this user's alone" in why
    events: list[tuple[str, dict]] = []
    starts = ZygoteStarts(None, None, shared.store, tmp_path, lambda e, **kw: events.append((e, kw)))  # type: ignore[arg-type]
    assert starts._restore("k1") is None
    [(name, ev)] = events
    assert name == "zygote-image" and ev["status"] == "refused" and ev["reason"] == why, events
    with pytest.raises(CriuError, match="image refused"):
        zygote_image.restore_zygote("/bin/false", shared.store, "k1", tmp_path / "log", tmp_path / "work")


def test_a_file_in_the_victims_own_image_that_others_could_write_is_refused(tmp_path: Path) -> None:
    root = zygote_image.images_root(tmp_path)
    (root / "k1").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    (root / "k1" / zygote_image.META).write_text(json.dumps({"pid": 999999}))
    (root / "k1" / "pages-1.img").write_bytes(b"pages")
    assert zygote_image.check_image(tmp_path, "k1") == (root / "k1", "")
    os.chmod(root / "k1" / "pages-1.img", 0o666)
    folder, why = zygote_image.check_image(tmp_path, "k1")
    assert folder is None and "pages-1.img is not a file of this user's alone" in why
