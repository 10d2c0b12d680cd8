"""A capture's life in an S3 store after its files are up (store/s3_store.py mixes this into S3Store): each node's
marker, the publish once every node's marker is in — one conditional PUT of the manifest (If-None-Match: *), so
of two racing captures exactly one publishes and the loser deletes its objects — and the cleanup of captures
that never publish (a node that failed, the claim holder's `discard_capture`, the next holder's `reap_captures`).
The methods use S3Store's object primitives (`key`, `get_object`, `put_json`, `objects`, `delete_prefix`).
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any, Optional

from mxlaunch.errors import CheckFailed
from mxlaunch.store.capture import PendingCapture, capture_ids
from mxlaunch.store.core import manifest_from_markers
from mxlaunch.store.snapshot import MANIFEST, SnapshotMeta

_DONE = re.compile(r"^(0|[1-9][0-9]{0,5})\.json$")
_FAILED = re.compile(r"^(0|[1-9][0-9]{0,5})\.failed\.json$")


class S3Publishing:
    """Markers, publish and discard on the bucket; mixed into S3Store ahead of Store, whose local-folder versions
    these replace."""

    s3: Any
    bucket: str

    def write_marker(self, source_id: str, capture_id: str, name: str, doc: dict) -> None:
        self.put_json(self.key(source_id, f".nodes-{capture_id}", name), doc)

    def _markers(self, source_id: str, capture_id: str) -> tuple[Optional[list[str]], list[str]]:
        names = [n for n in self.children_names(self.key(source_id, f".nodes-{capture_id}"))]
        if not names:
            return None, []
        return [n for n in names if _DONE.match(n)], [n for n in names if _FAILED.match(n)]

    def try_publish(self, source_id: str, capture_id: str, meta: SnapshotMeta, nranks: int, nnodes: int) -> bool:
        """Publish the manifest (PUT If-None-Match: *) once every node's marker is in; True only for the winner."""
        names, failed = self._markers(source_id, capture_id)
        if names is None or failed:
            return False

        def read(name: str) -> Optional[object]:
            got = self.get_object(self.key(source_id, f".nodes-{capture_id}", name), limit=16 << 20)
            try:
                return None if got is None else json.loads(got[0])
            except ValueError:
                return None

        manifest = manifest_from_markers((read(n) for n in names), source_id, capture_id, meta, nranks, nnodes)
        if manifest is None:
            return False
        from mxlaunch.coord.s3 import _race_lost  # noqa: PLC0415

        try:
            self.put_json(self.key(source_id, MANIFEST), manifest, IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001
            if not _race_lost(exc):
                raise
            if self._published_capture(source_id) not in (None, "?", capture_id):
                self.delete_prefix(self.key(source_id, f"data-{capture_id}") + "/")  # another capture won
                self.delete_prefix(self.key(source_id, f".nodes-{capture_id}") + "/")
            return False
        self.delete_prefix(self.key(source_id, f".nodes-{capture_id}") + "/")
        return True

    def pending(self, source_id: str, capture_id: str) -> PendingCapture:
        done, failed = self._markers(source_id, capture_id)
        out = PendingCapture(done={int(n.split(".")[0]) for n in done or []})
        for name in failed:
            try:
                got = self.get_object(self.key(source_id, f".nodes-{capture_id}", name), limit=1 << 20)
                data = json.loads(got[0]) if got else {}
                reason = str(data.get("reason", "no reason given")) if isinstance(data, dict) else "no reason given"
            except (ValueError, CheckFailed):
                reason = "its marker cannot be read"
            out.failed[int(name.split(".")[0])] = reason
        return out

    def mark_node_failed(self, source_id: str, capture_id: str, node_rank: int, reason: str) -> None:
        self.write_marker(source_id, capture_id, f"{node_rank}.failed.json",
                          {"schema": 1, "capture_id": capture_id, "node_rank": node_rank,
                           "host": socket.gethostname(), "reason": reason})

    def discard_capture(self, source_id: str, capture_id: str) -> bool:
        """Remove an unpublished capture: its markers first (no publisher finds a complete set any more), then
        its data objects and unfinished uploads, and this node's local temp folder."""
        import shutil  # noqa: PLC0415

        shutil.rmtree(self.folder(source_id) / f".tmp-{capture_id}", ignore_errors=True)
        published = self._published_capture(source_id)
        if published is not None and published in (capture_id, "?"):
            return False
        n = self.delete_prefix(self.key(source_id, f".nodes-{capture_id}") + "/")
        n += self.delete_prefix(self.key(source_id, f"data-{capture_id}") + "/")
        return n > 0

    def reap_captures(self, source_id: str, keep: str) -> list[str]:
        """Discard every unpublished capture of `source_id` but `keep` (call it holding the claim)."""
        published = self._published_capture(source_id)
        if published == "?":
            return []
        ids = self.capture_ids(source_id)
        return sorted(cid for cid in ids - {keep, published} if self.discard_capture(source_id, cid))

    def capture_ids(self, source_id: str) -> set[str]:
        """The capture ids of the parts under `source_id` (data-, .nodes- and unfinished uploads)."""
        base = self.key(source_id) + "/"
        names = self.children(self.key(source_id))
        for page in self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base):
            names.extend(u["Key"][len(base):].split("/")[0] for u in page.get("Uploads", []) or [])
        return capture_ids(names)

    def _published_capture(self, source_id: str) -> Optional[str]:
        try:
            got = self.get_object(self.key(source_id, MANIFEST))
        except CheckFailed:
            return "?"
        if got is None:
            return None
        try:
            data = json.loads(got[0])
        except ValueError:
            return "?"
        cid = data.get("capture_id") if isinstance(data, dict) else None
        return cid if isinstance(cid, str) else "?"
