"""Checksums of a snapshot image's files: written when it is published, checked before a restore reads it.

Why: an image kept in the artifact store (a lean engine snapshot, warmstart/lean_snapshot.py) is read by other
nodes and later jobs, over a shared filesystem that can hand back a file cut short (a copy or a quota that ran
out) or damaged. CRIU restoring such an image fails late or, worse, restores wrong memory. An xxh3-128 per file
(~0.3 s for a lean image of a few GB) catches that before anything is restored; a mismatch is one event and the
engine starts as usual. (Who may write the folder is checked elsewhere: only this user's own, private one.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import xxhash

from mxlaunch.fileutil import LAST_USED

SUMS = "sums.json"
CHUNK = 8 << 20


def file_sum(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def image_files(folder: Path) -> list[Path]:
    """Every regular file of the image, sorted: what CRIU and the restore read — not sums.json itself, nor the
    last-use stamp every restore touches (fileutil.mark_used: `store prune`'s clock, not part of the image)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()
                  and not (p.parent == folder and p.name in (SUMS, LAST_USED)))


def write_sums(folder: Path) -> int:
    """Write sums.json for `folder` (before it is published); the bytes summed."""
    files = image_files(folder)
    sums = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "xxh3_128": file_sum(p)} for p in files}
    fd = os.open(folder / SUMS, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(sums, f)
    return sum(v["bytes"] for v in sums.values())


def check_sums(folder: Path) -> Optional[str]:
    """Why `folder`'s files do not match its sums.json (None: they all do, and nothing was added or lost)."""
    try:
        sums = json.loads((folder / SUMS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"its {SUMS} cannot be read: {exc}"
    have = {str(p.relative_to(folder)): p for p in image_files(folder)}
    if set(have) != set(sums):
        extra, lost = sorted(set(have) - set(sums)), sorted(set(sums) - set(have))
        return f"its files differ from {SUMS}: {len(lost)} missing {lost[:3]}, {len(extra)} unknown {extra[:3]}"
    for name, path in have.items():
        want = sums[name]
        if path.stat().st_size != want.get("bytes"):
            return f"{name} is {path.stat().st_size} bytes, {want.get('bytes')} when it was written"
        if file_sum(path) != want.get("xxh3_128"):
            return f"{name} does not match its checksum (damaged since it was written)"
    return None
