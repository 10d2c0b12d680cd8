"""Which store an artifact path names: a folder (store/core.py `Store`) or `s3://bucket/prefix`
(store/s3_store.py `S3Store`, boto3 imported only then). Every command that takes --artifact-path opens its
store here, so an S3 URL works wherever a folder does; the two store modules never import each other's way."""

from __future__ import annotations

import os
from typing import Optional

from mxlaunch.coord.base import Coordinator
from mxlaunch.store.core import Store
from mxlaunch.store.snapshot import default_root


def is_s3(root: str | os.PathLike[str] | None) -> bool:
    """An S3 URL, also in the `s3:/bucket` form pathlib and typer's Path options leave of it."""
    return str(root if root is not None else default_root()).startswith("s3:/")


def open_store(root: str | os.PathLike[str] | None = None, coordinator: Optional[Coordinator] = None) -> Store:
    """The store at `root` (else $MXLAUNCH_ARTIFACT_PATH, else the user cache dir)."""
    if is_s3(root):
        from mxlaunch.store.s3_store import S3Store  # noqa: PLC0415 — boto3 only where an S3 store is used

        return S3Store(root, coordinator)
    return Store(root, coordinator)
