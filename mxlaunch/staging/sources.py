"""Turn `SRC...` arguments (files, directories, globs) into a list of copies, checked up front.

A file lands as DEST/<basename>; a directory as DEST/<basename>/<its tree>. Every problem —
a missing source, two sources mapping to one destination — is found before a byte moves.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from mxlaunch.errors import UsageError

PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class CopyItem:
    """One file to copy: where it comes from, where it lands (relative to DEST), its size."""

    src: Path
    rel: str
    size: int


def _walk_dir(root: Path) -> list[tuple[Path, str]]:
    base = root.name or root.resolve().name
    found: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            found.append((full, str(Path(base) / full.relative_to(root))))
    return found


def expand_sources(sources: list[str]) -> list[CopyItem]:
    """Resolve files, directories and globs into CopyItems; raise UsageError on any conflict."""
    if not sources:
        raise UsageError("no source given", "name at least one file, directory or glob to stage")
    pairs: list[tuple[Path, str]] = []
    for spec in sources:
        matches = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matches:
            raise UsageError(f"no file matches {spec!r}", "check the glob pattern and quote it for the shell")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                pairs.extend(_walk_dir(path))
            elif path.is_file():
                pairs.append((path, path.name))
            elif path.exists():
                raise UsageError(f"{match} is not a regular file or directory", "stage files or folders only")
            else:
                raise UsageError(f"source {match} does not exist", "check the path")
    seen: dict[str, Path] = {}
    items: list[CopyItem] = []
    for src, rel in pairs:
        if rel.endswith(PARTIAL_SUFFIX):
            raise UsageError(f"{src} ends in {PARTIAL_SUFFIX}", "that suffix marks unfinished copies; rename the file")
        other = seen.get(rel)
        if other is not None:
            if other.resolve() == src.resolve():
                continue  # the same file named twice (e.g. a glob and its directory): copy once
            raise UsageError(
                f"{other} and {src} would both land at DEST/{rel}",
                "stage them into different destinations or rename one",
            )
        seen[rel] = src
        try:
            size = src.stat().st_size
        except OSError as exc:
            raise UsageError(f"cannot read {src}: {exc.strerror}", "check the path and its permissions") from exc
        if not os.access(src, os.R_OK):
            raise UsageError(f"cannot read {src}: permission denied", "check its permissions")
        items.append(CopyItem(src=src, rel=rel, size=size))
    return items
