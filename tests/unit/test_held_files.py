"""Files a snapshot's processes hold (warmstart/held_files.py): a node that lacks a small cache file gets the copy
kept at the dump; one without a copy is named; nothing that exists is touched."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mxlaunch.warmstart import held_files

pytestmark = pytest.mark.unit


def test_a_missing_cache_file_comes_back_from_the_image_and_a_missing_big_one_is_named(tmp_path: Path) -> None:
    cache = tmp_path / "home" / ".nv" / "ComputeCache"
    cache.mkdir(parents=True)
    (cache / "index").write_bytes(b"cuda jit index")
    os.chmod(cache / "index", 0o644)  # CRIU reopens it only with the mode it had (seen on the H200: "bad mode")
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(held_files.COPY_LIMIT + 1)
    image = tmp_path / "image"
    image.mkdir()
    paths = held_files.held_paths([1], lambda _pid: [str(cache / "index"), "pipe:[7]", "/dev/nvidiactl"],
                                  lambda _pid: [str(big), str(cache / "index"), "/dev/shm/x (deleted)"])
    assert paths == sorted([str(cache / "index"), str(big)])  # regular files with a name, each once
    held = held_files.record(paths, image)
    by_path = {h["path"]: h for h in held}
    assert by_path[str(cache / "index")]["copy"] and "copy" not in by_path[str(big)]  # too big to keep
    assert held_files.put_back(image, held) == ([], "")  # all there: nothing made
    (cache / "index").unlink()
    os.rmdir(cache)  # a wiped node: the folders went too
    made, why = held_files.put_back(image, held)
    assert made == [str(cache / "index")] and why == ""
    assert (cache / "index").read_bytes() == b"cuda jit index" and (cache.stat().st_mode & 0o777) == 0o700
    assert ((cache / "index").stat().st_mode & 0o777) == 0o644
    big.unlink()
    made, why = held_files.put_back(image, held)
    assert made == [] and why == f"the image holds {big} open, and this node has no such file"


def test_the_software_itself_is_never_copied_into_an_image(tmp_path: Path) -> None:
    lib = next(Path(p) for p in sys.path if p.endswith("-packages") and Path(p).is_dir())
    some = next(p for p in lib.rglob("*.py") if p.stat().st_size > 0)
    held = held_files.record([str(some)], tmp_path)
    assert "copy" not in held[0] and held[0]["bytes"] == some.stat().st_size
    assert not (tmp_path / held_files.FOLDER).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root (CI runs as root)")
def test_a_held_name_another_user_made_first_refuses_the_restore(tmp_path: Path) -> None:
    """On a new node another user may create a cache path the image holds before the first restore: CRIU would
    reopen or map that file in the restored engine, so the restore is refused, naming it."""
    held_path = tmp_path / "cache" / "launcher.so"
    held_path.parent.mkdir()
    held_path.write_bytes(b"planted")
    os.chown(held_path, 4242, 4242)
    made, why = held_files.put_back(tmp_path, [{"path": str(held_path), "bytes": 7, "mode": 0o644}])
    assert made == [] and why == f"{held_path}, which the image holds open, belongs to uid 4242: not restoring into it"
