"""A store-held image is staged into the run folder and checked as it lands before CRIU reads the copy
(warmstart/image_stage.py): the copy is exactly the image, a damaged one is refused with nothing left behind, a
node without room restores from the store (checked in place), and both restores — a zygote image's and a lean
engine snapshot's — hand CRIU the copy. CRIU itself stands in here; tests/e2e/test_zygote_image.py runs it."""

from __future__ import annotations

import json
import shutil
import os
from pathlib import Path
from typing import Any

import pytest

from mxlaunch.warmstart import criu, image_stage, zygote, zygote_image
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.image_stage import ImageDamaged, NoRoom, stage_image
from mxlaunch.warmstart.image_sums import SUMS, write_sums
from tests.unit.test_zygote import module_dir  # noqa: F401 — the fixture

pytestmark = pytest.mark.unit


def _image(folder: Path, pid: int = 999999, nested: bool = True) -> Path:
    """An image's kinds of files; `nested`: a folder in it too (an engine snapshot's held files; a zygote
    image is flat)."""
    (folder / "held").mkdir(parents=True) if nested else folder.mkdir(parents=True)
    (folder / "pages-1.img").write_bytes(os.urandom(3 << 20) + b"tail")  # not a multiple of the O_DIRECT block
    (folder / "core-7.img").write_bytes(b"core")
    (folder / "empty.img").write_bytes(b"")
    (folder / ("held/0" if nested else "held-0")).write_bytes(b"a held cache file")
    (folder / "meta.json").write_text(json.dumps({"pid": pid}))
    write_sums(folder)
    return folder


def _private(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_copy_is_the_image_and_says_how_fast_it_came(tmp_path: Path) -> None:
    image, root = _image(tmp_path / "store" / "k1"), _private(tmp_path / "run")
    os.chmod(image / "core-7.img", 0o600)  # a semaphore's link-remap, say; a stage under umask 002 would make 0664
    old = os.umask(0o002)
    try:
        copy, info = stage_image(image, root)
    finally:
        os.umask(old)
    want = {k: v for k, v in _files(image).items() if k != SUMS}
    assert copy.parent == root and _files(copy) == want
    assert info["image_stage_s"] >= 0 and "image_gib_per_s" in info
    assert os.stat(copy).st_mode & 0o077 == 0  # a folder of this user's alone: nobody changes it before CRIU reads
    for rel in want:  # each file with the image's mode (put back with it; CRIU checks it), whatever the umask
        assert os.stat(copy / rel).st_mode == os.stat(image / rel).st_mode, rel
    image_stage.remove_copy(copy)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("damage", ["byte", "missing", "planted", "sums"])
def test_a_damaged_image_is_refused_and_leaves_nothing(tmp_path: Path, damage: str) -> None:
    image, root = _image(tmp_path / "store" / "k1"), _private(tmp_path / "run")
    if damage == "byte":  # the size kept: only the checksum of what landed can tell
        with open(image / "pages-1.img", "r+b") as f:
            f.seek(2 << 20)
            f.write(b"X")
    elif damage == "missing":
        (image / "held" / "0").unlink()
    elif damage == "planted":
        (image / "planted.img").write_bytes(b"x")
    else:
        (image / SUMS).write_text("{")
    with pytest.raises(ImageDamaged, match={"byte": "pages-1.img: checksum", "missing": r"1 missing \['held/0'\]",
                                            "planted": r"1 unknown \['planted.img'\]", "sums": "cannot be read"}[damage]):
        stage_image(image, root)
    assert list(root.iterdir()) == []


def test_no_room_for_the_copy_is_not_a_damaged_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.staging import reader
    from mxlaunch.staging.capacity import Capacity

    image, root = _image(tmp_path / "store" / "k1"), _private(tmp_path / "run")
    monkeypatch.setattr(reader, "capacity_of", lambda dest: Capacity(path="/the-tests-tmpfs", fs_type="tmpfs", fs_free=1000,
                                                                      memory_backed=False, cgroup_headroom=None,
                                                                      ram_available=1 << 40))
    with pytest.raises(NoRoom, match="free space on /the-tests-tmpfs"):
        stage_image(image, root)
    assert list(root.iterdir()) == []


def test_an_image_that_would_leave_the_weights_no_room_is_not_copied(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A lean restore copies its image before the weights' stage: the image fits, the two together do not — no
    copy (restored in place), else the stage after it would run out of room and the engine load on its own."""
    from mxlaunch.staging import reader
    from mxlaunch.staging.capacity import Capacity

    image, root = _image(tmp_path / "store" / "k1"), _private(tmp_path / "run")
    size = sum(p.stat().st_size for p in image.iterdir())
    monkeypatch.setattr(reader, "capacity_of", lambda dest: Capacity(path="/the-tests-tmpfs", fs_type="tmpfs",
                                                                      fs_free=size + (1 << 20), memory_backed=False,
                                                                      cgroup_headroom=None, ram_available=1 << 40))
    copy, _ = stage_image(image, root)  # alone it fits
    shutil.rmtree(copy)
    with pytest.raises(NoRoom, match="reserved"):
        stage_image(image, root, reserve_bytes=2 << 20)
    assert list(root.iterdir()) == []


def test_a_read_that_fails_refuses_the_image_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.staging import reader

    image, root = _image(tmp_path / "store" / "k1"), _private(tmp_path / "run")

    def gone(self: Any, poll: float = 0.2) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(reader.StageJob, "wait", gone)
    with pytest.raises(ImageDamaged, match="reading it failed: Input/output error"):
        stage_image(image, root)
    assert list(root.iterdir()) == []


def _criu_reads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """criu.restore stands in: it records what it was handed and whether that was there to read."""
    seen: list[dict[str, Any]] = []

    def restore(binary: str, images: Path, work: Path, timeout: float = 60.0, extra: tuple = (),
                pass_fds: tuple = ()) -> int:
        seen.append({"images": Path(images), "files": _files(Path(images)), "pass_fds": pass_fds})
        raise CriuError("stand-in: nothing restored")

    monkeypatch.setattr(criu, "restore", restore)
    return seen


def _zygote_store(module_dir: Path) -> tuple[Path, Path]:
    """A store with this user's zygote-image folder (and the zygote root the restore needs): (store, images)."""
    zygote.zygote_root().mkdir(mode=0o700, exist_ok=True)
    store = module_dir / "store"
    root = zygote_image.images_root(store)
    root.mkdir(parents=True, mode=0o700, exist_ok=True)
    return store, root


def test_a_zygote_image_is_restored_from_its_checked_copy(module_dir: Path,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    store, root = _zygote_store(module_dir)
    image = _image(root / "k1", nested=False)
    run = _private(module_dir / "run")
    seen = _criu_reads(monkeypatch)
    with pytest.raises(CriuError, match="stand-in"):
        zygote_image.restore_zygote("/bin/false", store, "k1", module_dir / "log", module_dir / "work", stage_root=run)
    [read] = seen
    assert read["images"].parent == run and read["pass_fds"] == ()
    assert read["files"] == {k: v for k, v in _files(image).items() if k != SUMS}
    assert list(run.iterdir()) == []  # the copy goes once CRIU has read it

    with open(image / "pages-1.img", "r+b") as f:  # damaged after it was published: refused before CRIU runs
        f.write(b"X")
    with pytest.raises(CriuError, match=r"image refused: .*k1 is damaged: pages-1.img: checksum"):
        zygote_image.restore_zygote("/bin/false", store, "k1", module_dir / "log", module_dir / "work", stage_root=run)
    assert len(seen) == 1 and list(run.iterdir()) == []


def test_a_lean_snapshot_from_the_store_is_restored_from_its_checked_copy(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.warmstart import engine_snapshots
    from mxlaunch.warmstart.engine_snapshot import META, snapshots_root

    events: list[tuple[str, dict]] = []
    run = _private(tmp_path / "run")
    snaps = engine_snapshots.EngineSnapshots(False, [], "sid", run, tmp_path / "logs",
                                             lambda e, **f: events.append((e, f)),
                                             environ={"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps")})
    snaps.binary, snaps.key = "/bin/true", "k1"
    folder = _private(snapshots_root(snaps.root_env)) / "k1"
    folder.mkdir()
    (folder / META).write_text(json.dumps({"lean": True, "pids": [999999]}))
    _image(folder)  # its meta.json is the snapshot's
    seen: list[Path] = []

    def restore(binary: str, images: Path, work: Path) -> tuple[Any, dict]:
        seen.append(Path(images))
        assert (Path(images) / "pages-1.img").read_bytes() == (folder / "pages-1.img").read_bytes()
        raise engine_snapshots.SnapshotError("stand-in: nothing restored")

    monkeypatch.setattr(engine_snapshots, "restore", restore)
    assert snaps.try_restore("staged") is None
    assert seen and seen[0].parent == run and list(run.iterdir()) == []
    assert events[-1][1]["status"] == "failed" and "stand-in" in events[-1][1]["reason"]

    with open(folder / "core-7.img", "r+b") as f:
        f.write(b"X")
    assert snaps.try_restore("staged") is None and len(seen) == 1
    assert events[-1][1]["status"] == "skipped" and "core-7.img: checksum" in events[-1][1]["reason"], events[-1]


def test_an_image_staged_ahead_is_the_one_restored_or_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stage_image_ahead copies the image before the weights' stage; try_restore restores that copy (no second
    copy), and drop_ahead removes it when no restore follows."""
    from mxlaunch.warmstart import engine_snapshots
    from mxlaunch.warmstart.engine_snapshot import META, snapshots_root

    run = _private(tmp_path / "run")
    snaps = engine_snapshots.EngineSnapshots(False, [], "sid", run, tmp_path / "logs", lambda e, **f: None,
                                             environ={"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps")})
    snaps.binary, snaps.key = "/bin/true", "k1"
    folder = _private(snapshots_root(snaps.root_env)) / "k1"
    folder.mkdir()
    (folder / META).write_text(json.dumps({"lean": True, "pids": [999999]}))
    _image(folder)
    copies: list[Path] = []
    real = engine_snapshots.stage_image
    monkeypatch.setattr(engine_snapshots, "stage_image", lambda *a, **k: copies.append(a[0]) or real(*a, **k))
    restored: list[Path] = []

    def restore(binary: str, images: Path, work: Path) -> tuple[Any, dict]:
        restored.append(Path(images))
        raise engine_snapshots.SnapshotError("stand-in: nothing restored")

    monkeypatch.setattr(engine_snapshots, "restore", restore)
    snaps.stage_image_ahead("staged")
    [copy] = [p for p in run.rglob("*") if p.name == "pages-1.img"]
    assert snaps.try_restore("staged") is None
    assert len(copies) == 1 and restored == [copy.parent] and list(run.iterdir()) == []

    snaps.stage_image_ahead("staged")
    assert any(run.rglob("pages-1.img"))
    snaps.drop_ahead()
    assert list(run.iterdir()) == [] and len(copies) == 2


def test_an_image_whose_pid_is_held_is_refused_before_a_byte_is_copied(module_dir: Path,  # noqa: F811
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store, root = _zygote_store(module_dir)
    _image(root / "k2", pid=os.getpid(), nested=False)  # this process holds the pid the image must get back
    run = _private(module_dir / "run2")
    copied: list[Path] = []
    real = image_stage.stage_image

    def watched(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        copied.append(got[0])
        return got

    monkeypatch.setattr(zygote_image, "stage_image", watched)
    with pytest.raises(CriuError, match="belongs to a running process"):
        zygote_image.restore_zygote("/bin/false", store, "k2", module_dir / "log", module_dir / "work", stage_root=run)
    assert copied == [] and list(run.iterdir()) == []
