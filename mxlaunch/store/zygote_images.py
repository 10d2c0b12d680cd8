"""Where zygote images live in a store, and which are there: the layout (`zygote-images/<uid>/<key>/meta.json`),
and the listing the store's prune and `mxlaunch zygotes` read. Below both the store and the launcher: making,
checking and restoring an image is the launcher's (warmstart/zygote_image.py), which builds on this layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mxlaunch.fileutil import last_used
from mxlaunch.safety.ownership import private_dir

IMAGES = "zygote-images"
META = "meta.json"


def images_root(store_root: Path) -> Path:
    return Path(store_root) / IMAGES / str(os.getuid())


def image_dir(store_root: Path, key: str) -> Path:
    return images_root(store_root) / key


def list_images(store_root: Path) -> list[dict]:
    """This user's images in the store: key, bytes, made and last used (epoch seconds), newest use first."""
    root = images_root(store_root)
    if not private_dir(root):
        return []
    found = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not (folder / META).is_file():
            continue
        try:
            meta = json.loads((folder / META).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = {}
        found.append({"key": folder.name, "bytes": meta.get("bytes"), "made": meta.get("made"),
                      "last_used": last_used(folder, META), "path": str(folder)})
    return sorted(found, key=lambda i: -(i["last_used"] or 0))
