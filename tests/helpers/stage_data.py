"""Test data for staging: bytes whose every 4 KiB block names its own offset, so a chunk landing
at the wrong place is caught, plus random filler so equal blocks never hide a mix-up."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

BLOCK = 4096


def write_pattern_file(path: Path, size: int, seed: int = 0) -> str:
    """Write `size` bytes to `path`; return their sha256."""
    filler = hashlib.shake_256(f"{seed}".encode()).digest(1 << 20)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        offset = 0
        while offset < size:
            n = min(1 << 20, size - offset)
            piece = bytearray(filler[:n])
            for block in range(0, n, BLOCK):
                stamp = f"{seed}:{offset + block}|".encode()
                piece[block : block + len(stamp)] = stamp[: max(0, min(len(stamp), n - block))]
            fh.write(piece)
            digest.update(piece)
            offset += n
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def tree_of(root: Path) -> list[str]:
    """Every path under root (files and folders), relative, sorted — for 'nothing left behind'."""
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def shm_dir(name: str) -> Path:
    """A fresh folder in /dev/shm for one test (tmpfs: the real destination of staging)."""
    base = Path("/dev/shm") / f"mxlaunch-test-{os.getpid()}" / name
    return base


def shm_dest(request: Any) -> Iterator[Path]:
    """Fixture body: this test's /dev/shm folder, empty at the start and gone (with its parent) after."""
    path = shm_dir(request.node.name)
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)
