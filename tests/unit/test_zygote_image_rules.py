"""Zygote images without CRIU: which CRIU may run (warmstart/criu.py), which images may be restored (only this
user's, in a folder nobody else can enter), and the handshake's way out — a zygote started for an image whose
launcher stops before it is dumped serves as a plain zygote at once. Real zygote processes; the dump and
restore themselves, with a real CRIU, are tests/e2e/test_zygote_image.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from mxlaunch.contract import ZYGOTE_DUMPABLE, ZYGOTE_RESUME
from mxlaunch.warmstart import criu, zygote, zygote_image
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.plugin.zygote import READY_LINE
from tests.unit.test_zygote import _entry, _env, _stop, module_dir  # noqa: F401 — the fixture

ROOT_CAPS = "CapEff:\t000001ffffffffff\n"
NO_CAPS = "CapEff:\t0000000000000000\n"


def fake_criu(folder: Path, version: str) -> str:
    path = folder / "criu"
    path.write_text(f"#!/bin/sh\necho 'Version: {version}'\n")
    path.chmod(0o755)
    return str(path)


def test_which_criu_may_run(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    new, old = fake_criu(tmp_path, "4.1.1"), fake_criu(tmp_path / "old", "3.17.1")
    assert criu.why_not({"MXLAUNCH_CRIU": new}, ROOT_CAPS) == (new, "")
    binary, why = criu.why_not({"MXLAUNCH_CRIU": old}, ROOT_CAPS)
    assert binary is None and "criu 3.17.1 is older than 4.0" in why
    binary, why = criu.why_not({"MXLAUNCH_CRIU": new}, NO_CAPS)
    assert binary is None and "no CAP_CHECKPOINT_RESTORE" in why
    assert criu.why_not({"MXLAUNCH_CRIU": new}, "CapEff:\t0000000000200000\n") == (new, "")  # CAP_SYS_ADMIN does too
    binary, why = criu.why_not({"MXLAUNCH_CRIU": str(tmp_path / "missing")}, ROOT_CAPS)
    assert binary is None and "is not executable" in why and "build_criu_kit.sh" in why
    binary, why = criu.why_not({"PATH": str(tmp_path / "empty")}, ROOT_CAPS)
    assert binary is None and why.startswith("no criu on PATH")


def publish_fake_image(store: Path, key: str, pid: int = 999999) -> Path:
    root = zygote_image.images_root(store)
    root.mkdir(parents=True, mode=0o700)
    folder = root / key
    folder.mkdir()
    (folder / zygote_image.META).write_text(json.dumps({"pid": pid}))
    return folder


def test_only_an_image_in_this_users_private_folder_is_found(tmp_path: Path) -> None:
    folder = publish_fake_image(tmp_path, "k1")
    assert zygote_image.find_image(tmp_path, "k1") == folder
    assert zygote_image.find_image(tmp_path, "k2") is None
    os.chmod(zygote_image.images_root(tmp_path), 0o755)  # others may enter: someone could have put an image there
    assert zygote_image.find_image(tmp_path, "k1") is None
    with pytest.raises(CriuError, match="image refused: .* is not a folder of this user's alone"):
        zygote_image.restore_zygote("/bin/false", tmp_path, "k1", tmp_path / "log", tmp_path / "work")
    with pytest.raises(CriuError, match="no image for this zygote yet"):
        zygote_image.restore_zygote("/bin/false", tmp_path, "k2", tmp_path / "log", tmp_path / "work")


def test_a_restore_whose_pid_is_held_names_it_and_leaves_no_resume_file(module_dir: Path) -> None:  # noqa: F811
    zygote.zygote_root().mkdir(mode=0o700)
    publish_fake_image(module_dir / "store", "k1", pid=os.getpid())  # this process holds the image's pid
    with pytest.raises(CriuError, match=f"pid {os.getpid()}, which the image must get back, belongs to a running"):
        zygote_image.restore_zygote("/bin/false", module_dir / "store", "k1", module_dir / "log", module_dir / "work")
    assert not (zygote.zygote_root() / f"k1{ZYGOTE_RESUME}").exists()


def test_a_damaged_image_is_refused_before_criu_reads_it(module_dir: Path) -> None:  # noqa: F811
    """An image travels through the store to other nodes and jobs: its sums (written at the dump) are checked
    before a restore, and a file changed since is named; CRIU is never run on it."""
    from mxlaunch.warmstart.image_sums import write_sums

    zygote.zygote_root().mkdir(mode=0o700, exist_ok=True)
    folder = publish_fake_image(module_dir / "store", "k3")
    (folder / "pages-1.img").write_bytes(b"memory" * 1000)
    write_sums(folder)
    with open(folder / "pages-1.img", "r+b") as f:  # a shared file system handed back a damaged copy
        f.write(b"X")
    with pytest.raises(CriuError, match=r"image refused: .*k3 is damaged: pages-1.img does not match its checksum"):
        zygote_image.restore_zygote("/bin/false", module_dir / "store", "k3", module_dir / "log", module_dir / "work")
    assert not (zygote.zygote_root() / f"k3{ZYGOTE_RESUME}").exists()


def test_a_zygote_whose_launcher_stops_before_the_dump_serves_plain_at_once(module_dir: Path) -> None:  # noqa: F811
    """Started for an image, the zygote stands still after its imports; the launcher stops first (abandon): it
    must then publish its socket and log again, not wait out --image-wait-s (300 s)."""
    env = _env(module_dir)
    key = zygote.zygote_key(_entry(), "1", env, str(module_dir))
    pid = zygote.start_zygote(key, _entry(), env, str(module_dir), module_dir / "logs", for_image=True)
    assert pid is not None
    maker = zygote_image.ImageMaker("/bin/false", pid, key, module_dir / "store", module_dir / "logs" / "zygote.log",
                                    module_dir / "work", lambda *a, **k: None)
    dumpable = zygote.zygote_root() / f"{key}{ZYGOTE_DUMPABLE}"
    try:
        deadline = time.monotonic() + 60
        while not dumpable.exists():  # imported and standing still, nothing published
            assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0
            time.sleep(0.02)
        assert json.loads(dumpable.read_text()) == {"pid": pid} and not zygote.socket_path(key).exists()
        maker.abandon()
        deadline = time.monotonic() + 30
        while not zygote.socket_path(key).exists():
            assert time.monotonic() < deadline, (module_dir / "logs" / "zygote.log").read_text()
            time.sleep(0.02)
        child = zygote.fork_from(key, _entry(("5",)), env, str(module_dir))
        assert child is not None and child.wait(timeout=30) == 5
        log = (module_dir / "logs" / "zygote.log").read_text()
        assert f"{READY_LINE} imported=" in log and "restored=no" in log, log
        assert not dumpable.exists() and not (zygote.zygote_root() / f"{key}{ZYGOTE_RESUME}").exists()
    finally:
        _stop(pid)


def test_the_maker_claims_only_its_own_zygotes_marker(module_dir: Path) -> None:  # noqa: F811
    """A marker left by another pid (a zygote that died standing still) is not claimed, and a maker whose
    zygote exits says so instead of dumping anything."""
    zygote.zygote_root().mkdir(mode=0o700)
    (zygote.zygote_root() / f"k1{ZYGOTE_DUMPABLE}").write_text(json.dumps({"pid": 1}))
    events: list[tuple[str, dict]] = []
    import subprocess

    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    maker = zygote_image.ImageMaker("/bin/false", short.pid, "k1", module_dir / "store", module_dir / "log",
                                    module_dir / "work", lambda e, **f: events.append((e, f)), wait_s=30)
    maker.start()
    short.wait()
    maker.join(30)
    assert events == [("zygote-image", {"status": "failed", "key": "k1",
                                        "reason": "the zygote exited before it had imported (see zygote.log)"})]
    assert (zygote.zygote_root() / f"k1{ZYGOTE_DUMPABLE}").exists()  # the dead one's marker was left alone
    assert not zygote_image.images_root(module_dir / "store").exists()


def test_a_zygote_that_holds_gpu_device_files_is_not_dumped_and_the_event_says_why(module_dir: Path) -> None:  # noqa: F811
    """On the H200 vLLM's imports initialised the CUDA driver: the zygote then holds /dev/nvidia* open, which
    CRIU cannot dump. Such a zygote writes why in its marker and serves without waiting; the maker reads it,
    says it in the event, removes the marker and dumps nothing. A real zygote started for an image, whose
    preloaded module makes its device-file scan report /dev/nvidiactl (no GPU here)."""
    (module_dir / "mxz_gpu.py").write_text(
        "import sys\nsys.modules['mxlaunch.plugin.zygote_dump'].device_files = lambda: ['/dev/nvidiactl']  # its scan\n")
    env = _env(module_dir)
    entry = zygote.ZygoteEntry(sys.executable, "module", "mxz_child", (), ("mxz_gpu",))
    key = zygote.zygote_key(entry, "1", env, str(module_dir))
    pid = zygote.start_zygote(key, entry, env, str(module_dir), module_dir / "logs", for_image=True)
    assert pid is not None
    events: list[tuple[str, dict]] = []
    maker = zygote_image.ImageMaker("/bin/false", pid, key, module_dir / "store", module_dir / "logs" / "zygote.log",
                                    module_dir / "work", lambda e, **f: events.append((e, f)), wait_s=60)
    try:
        maker.start()
        maker.join(90)
        why = "the imports left GPU device files open (/dev/nvidiactl), which CRIU cannot dump"
        assert events == [("zygote-image", {"status": "failed", "key": key,
                                            "reason": f"the zygote cannot be dumped: {why}"})]
        assert not (zygote.zygote_root() / f"{key}{ZYGOTE_DUMPABLE}").exists()
        assert not zygote_image.images_root(module_dir / "store").exists()
        deadline = time.monotonic() + 30  # it serves at once, as a plain zygote
        while not zygote.socket_path(key).exists():
            assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0
            time.sleep(0.02)
        child = zygote.fork_from(key, _entry(("5",)), env, str(module_dir))
        assert child is not None and child.wait(timeout=30) == 5
        log = (module_dir / "logs" / "zygote.log").read_text()
        assert f"no image — {why}" in log and "restored=no" in log, log
    finally:
        _stop(pid)


def test_zygotes_lists_this_users_images_in_the_store(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    folder = publish_fake_image(tmp_path / "store", "k" * 20)
    (folder / zygote_image.META).write_text(json.dumps({"pid": 1, "bytes": 5 << 20, "made": 1.0}))
    result = run_cli("zygotes", "--artifact-path", str(tmp_path / "store"), "--json")
    assert result.returncode == 0, result.stderr
    [image] = json.loads(result.stdout)["images"]
    assert image["key"] == "k" * 20 and image["bytes"] == 5 << 20 and image["path"] == str(folder)
    text = run_cli("zygotes", "--artifact-path", str(tmp_path / "store"))
    assert f"{'k' * 20} image: 5 MiB" in text.stdout, text.stdout
