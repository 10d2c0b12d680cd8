"""Staging manifests: relative path → {"bytes", "xxh3_128"}, read strictly, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mxlaunch.fileutil import write_json_atomic

from mxlaunch.errors import UsageError

_HEX32 = set("0123456789abcdef")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, dict]:
    """Load and validate a manifest; any defect is a one-line UsageError naming the fix."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise UsageError(f"manifest {path} does not exist", "check the path") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read manifest {path}: {exc}", "check the file") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"manifest {path} is not valid JSON ({exc.msg}, line {exc.lineno})",
                         "write it again with --write-manifest") from exc
    files = data.get("files", data) if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise UsageError(f"manifest {path} must be a JSON object of path → {{bytes, xxh3_128}}",
                         "write it with --write-manifest")
    for rel, entry in files.items():
        if rel == "schema":
            continue
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and entry["bytes"] >= 0
            and isinstance(entry.get("xxh3_128"), str)
            and len(entry["xxh3_128"]) == 32
            and set(entry["xxh3_128"]) <= _HEX32
        )
        if not ok:
            raise UsageError(f"manifest {path}: entry {rel!r} needs integer 'bytes' and a 32-hex 'xxh3_128'",
                             "write it again with --write-manifest")
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise UsageError(f"manifest {path}: entry {rel!r} leaves the destination", "use relative paths")
    return {k: v for k, v in files.items() if k != "schema"}


def write_manifest(path: str | os.PathLike[str], entries: dict[str, dict]) -> None:
    """Write via a temp file in the same folder and an atomic rename: never half-written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, dict(sorted(entries.items())))
