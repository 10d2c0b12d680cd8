"""A snapshot image kept in the store is checked before a restore reads it (warmstart/image_sums.py), and only a
lean snapshot goes into the store (warmstart/engine_snapshots.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxlaunch.fileutil import mark_used
from mxlaunch.warmstart.engine_snapshots import STORE_FOLDER, EngineSnapshots
from mxlaunch.warmstart.image_sums import SUMS, check_sums, write_sums

pytestmark = pytest.mark.unit


def _image(folder: Path) -> Path:
    (folder / "link-remaps").mkdir(parents=True)
    (folder / "pages-1.img").write_bytes(b"p" * 100_000)
    (folder / "core-7.img").write_bytes(b"core")
    (folder / "link-remaps" / "link_remap.3").write_bytes(b"sem")
    return folder


def test_an_image_that_changed_since_it_was_written_is_named_with_what_changed(tmp_path: Path) -> None:
    image = _image(tmp_path / "img")
    assert write_sums(image) == 100_000 + 4 + 3 and (image / SUMS).exists()
    assert check_sums(image) is None
    mark_used(image)  # every restore stamps its use (`store prune`): the image is the same image after it
    assert (image / ".last-used").exists() and check_sums(image) is None
    with open(image / "pages-1.img", "r+b") as f:  # one byte damaged, the size kept
        f.seek(5000)
        f.write(b"q")
    assert "pages-1.img does not match its checksum" in check_sums(image)
    (image / "pages-1.img").write_bytes(b"p" * 10)  # cut short
    assert "pages-1.img is 10 bytes, 100000" in check_sums(image)
    (image / "pages-1.img").write_bytes(b"p" * 100_000)
    (image / "planted.img").write_bytes(b"x")
    assert "1 unknown ['planted.img']" in check_sums(image)
    (image / "planted.img").unlink()
    (image / "link-remaps" / "link_remap.3").unlink()
    assert "1 missing ['link-remaps/link_remap.3']" in check_sums(image)
    (image / SUMS).unlink()
    assert "cannot be read" in check_sums(image)


def test_only_a_lean_snapshot_of_a_local_store_is_kept_in_the_store(tmp_path: Path) -> None:
    def snaps(environ: dict, store: Path | None = tmp_path / "store") -> EngineSnapshots:
        return EngineSnapshots(False, ["vllm", "serve", "m"], "sid", tmp_path, tmp_path, lambda *a, **k: None,
                               environ=environ, store_root=store)

    lean = snaps({"MXLAUNCH_SNAPSHOT_SLEEP": "lean"})
    assert lean.in_store and lean.root_env["MXLAUNCH_ENGINE_SNAPSHOTS"] == str(tmp_path / "store" / STORE_FOLDER)
    assert not snaps({"MXLAUNCH_SNAPSHOT_SLEEP": "1"}).in_store  # a full image (tens of GB) stays node-local
    assert not snaps({"MXLAUNCH_SNAPSHOT_SLEEP": "lean"}, store=None).in_store  # an S3 store: no folder for it
    chosen = snaps({"MXLAUNCH_SNAPSHOT_SLEEP": "lean", "MXLAUNCH_ENGINE_SNAPSHOTS": "/mine"})
    assert not chosen.in_store and chosen.root_env["MXLAUNCH_ENGINE_SNAPSHOTS"] == "/mine"  # the user's choice wins
