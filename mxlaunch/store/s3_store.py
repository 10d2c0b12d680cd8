"""The artifact store in an S3 bucket: `--artifact-path s3://bucket/prefix` (issue 25), read and bookkeeping side.

The published layout is the shared filesystem's (store/core.py), as object keys under the prefix:

    <prefix>/<source_id>/manifest.json                          published last, by PUT If-None-Match: *
    <prefix>/<source_id>/data-<capture_id>/ranks/<rank>/<file>  the snapshot's files (multipart uploads)
    <prefix>/<source_id>/.nodes-<capture_id>/<node_rank>.json   a node's completion marker (its files, checksums)
    <prefix>/<source_id>/.nodes-<capture_id>/<node_rank>.failed.json  a node that will not deliver its part
    <prefix>/.claims/<source_id>.claim                          the capture claim (coord/s3.py)

What differs, and why:

- **No temp folder in the bucket.** A node's capture is written node-locally first (the run folder in
  /dev/shm, else `capture_spool`, a folder on the node's disk) and uploaded once the engine is ready
  (store/s3_capture.py): a multipart upload is invisible until it completes, so `data-<capture_id>/` only
  ever holds whole files, and nothing reads them before the manifest names them.
- **The publish** is one conditional PUT of the manifest (`If-None-Match: *`): of two captures racing,
  exactly one publishes; the loser deletes its `data-<capture_id>/` (the same contract as the local link;
  store/s3_publish.py: markers, publish, discard).
- **The local mirror.** `root` is a node-local folder (`$XDG_CACHE_HOME/mxlaunch/s3-stores/<bucket>/<prefix>`)
  for what the launcher keeps beside a store and reads as files: S3 models downloaded for the engine
  (`.models`), the JIT kernel caches (`kernel-cache/`, so they are per node with an S3 store, not shared
  through the bucket) and the default P2P file registry (`.peers`: same-host only; use
  `--registry redis://…` across nodes). Its claims are S3 claims all the same.
- **Last use** is not stamped in the bucket (that would be a PUT per launch): `store prune --unused-for`
  counts from the manifest's upload time.
- **Staging** reads each rank's files with parallel ranged GETs straight into /dev/shm (staging/s3_stage.py).

Endpoint and credentials are boto3's (remote/s3.py `client`): AWS_ENDPOINT_URL(_S3), AWS_PROFILE, the
AWS_* keys, instance roles. A wrong bucket, missing credentials or an unreachable endpoint is one line
with its fix (UsageError, exit 2) as soon as the store is opened.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import xxhash

from mxlaunch import settings
from mxlaunch.coord.base import ClaimInfo, Coordinator, valid_id
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.fileutil import ensure_dir
from mxlaunch.store.capture import node_part, node_tmp
from mxlaunch.store.core import Store
from mxlaunch.store.s3_publish import S3Publishing
from mxlaunch.store.snapshot import (
    MANIFEST, Snapshot, SnapshotMeta, StoreEntry, _validate_manifest)

_ROOT = re.compile(r"^s3:/+([^/]+)(?:/(.*))?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_clients: dict[tuple, Any] = {}
_checked: set[tuple] = set()
_lock = threading.Lock()


def is_s3_root(root: object) -> bool:
    """An s3:// artifact path (also in the form pathlib leaves of it: `s3:/bucket/prefix`)."""
    return root is not None and str(root).startswith("s3:/")


def parse_root(root: object) -> tuple[str, str]:
    """s3://bucket/prefix → (bucket, prefix without slashes at its ends; may be empty)."""
    m = _ROOT.match(str(root))
    bucket, prefix = (m.group(1), (m.group(2) or "").strip("/")) if m else ("", "")
    if not _BUCKET.match(bucket) or (prefix and any(p in ("", ".", "..") for p in prefix.split("/"))):
        raise UsageError(f"{root!s} is not an S3 artifact path", "give it as s3://bucket/prefix")
    return bucket, prefix


def mirror_root(bucket: str, prefix: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The node-local folder beside an S3 store (see the module docstring)."""
    cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "mxlaunch" / "s3-stores" / bucket / (prefix or "_")


def _client(environ: Mapping[str, str]) -> Any:
    """One boto3 client per endpoint and credentials in this process (a launch opens the store several times)."""
    from mxlaunch.remote.s3 import client  # noqa: PLC0415 — boto3 is an extra

    key = tuple(environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                                         "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION"))
    with _lock:
        if key not in _clients:
            _clients[key] = client(environ)
        return _clients[key]


def refusal(exc: BaseException, url: str) -> UsageError:
    """boto3's errors on the store as one line each (remote/s3.py's, naming the store)."""
    from mxlaunch.remote.s3 import refusal as s3_refusal  # noqa: PLC0415

    return s3_refusal(exc, f"the artifact store {url}", may="list, read and write")


def _missing(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError  # noqa: PLC0415

    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchKey", "404")


class S3Store(S3Publishing, Store):
    """An artifact store under s3://bucket/prefix (store/opener.py `open_store(url)` makes it; module docstring)."""

    remote = True

    def __init__(self, root: str | os.PathLike[str] | None = None, coordinator: Optional[Coordinator] = None, *,
                 environ: Mapping[str, str] = os.environ) -> None:
        from mxlaunch.coord.s3 import S3Coordinator  # noqa: PLC0415 — one job per module

        raw = root if root is not None else settings.artifact_path(environ)
        self.bucket, self.prefix = parse_root(raw)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.root = mirror_root(self.bucket, self.prefix, environ)
        self.s3 = _client(environ)
        self._check_bucket(environ)
        self.coordinator: Coordinator = coordinator if coordinator is not None else S3Coordinator(self)

    def _check_bucket(self, environ: Mapping[str, str]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        key = (environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL"), self.bucket, id(self.s3))
        if key in _checked:
            return
        try:
            self.s3.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise refusal(exc, self.url) from None
        _checked.add(key)

    # ---- keys and objects ----

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def path_of(self, key: str) -> Path:
        """A key as the plan shows a snapshot's files: `s3:/bucket/key` (pathlib keeps one slash)."""
        return Path(f"s3://{self.bucket}/{key}")

    def key_of(self, path: object) -> str:
        """The key of a path made by `path_of`."""
        text = str(path)
        head = f"s3:/{self.bucket}/"
        if not text.startswith(head):
            raise UsageError(f"{text} is not in the artifact store {self.url}", "plan the launch again")
        return text[len(head):]

    def folder(self, source_id: str) -> Path:
        """The node-local folder of `source_id` (its capture's temp files); the snapshot itself is in the bucket."""
        if not valid_id(source_id):
            raise UsageError(f"{source_id!r} is not a valid source id", "use an id that `mxlaunch store list` shows")
        return self.root / source_id

    def get_object(self, key: str, limit: int = 64 << 20) -> Optional[tuple[bytes, str, float]]:
        """(body, ETag, last modified epoch s), or None when there is no such object."""
        try:
            resp = self.s3.get_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            if _missing(exc):
                return None
            raise
        body = resp["Body"].read(limit + 1)
        if len(body) > limit:
            raise CheckFailed(f"s3://{self.bucket}/{key} is larger than {limit} bytes", "it is not mxlaunch's record")
        return body, str(resp.get("ETag", "")), resp["LastModified"].timestamp()

    def put_json(self, key: str, doc: dict, **condition: str) -> str:
        resp = self.s3.put_object(Bucket=self.bucket, Key=key, Body=json.dumps(doc, indent=1).encode(),
                                  ContentType="application/json", **condition)
        return str(resp.get("ETag", ""))

    def objects(self, prefix: str) -> Iterator[dict]:
        """Every object under `prefix` (a key prefix, usually ending in '/')."""
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def children(self, prefix: str) -> list[str]:
        """The names one level below `prefix/` ('folders' of the key space)."""
        base = prefix + "/" if prefix else ""
        out = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
            out.extend(p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", []))
        return out

    def children_names(self, prefix: str) -> list[str]:
        """The object names directly below `prefix/`."""
        base = prefix + "/"
        return sorted(o["Key"][len(base):] for o in self.objects(base) if "/" not in o["Key"][len(base):])

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix` and abort its unfinished multipart uploads; the count deleted."""
        keys = [o["Key"] for o in self.objects(prefix)]
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
        self.abort_uploads(prefix)
        return len(keys)

    def abort_uploads(self, prefix: str) -> int:
        """Abort the multipart uploads under `prefix` (a killed upload's parts cost storage until then)."""
        n = 0
        for page in self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
            for up in page.get("Uploads", []) or []:
                try:
                    self.s3.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    n += 1
                except Exception as exc:  # noqa: BLE001
                    if not _missing(exc) and "NoSuchUpload" not in str(exc):
                        raise
        return n

    # ---- reading ----

    def exists(self, source_id: str) -> bool:
        self.folder(source_id)  # validates the id
        return any(True for _ in self.objects(self.key(source_id) + "/"))

    def _load(self, source_id: str) -> tuple[Optional[Snapshot], str]:
        if not valid_id(source_id):
            return None, f"{source_id!r} is not a valid source id"
        got = self.get_object(self.key(source_id, MANIFEST))
        if got is None:
            if self.exists(source_id):
                return None, f"snapshot {source_id} has no manifest (its capture never finished)"
            return None, f"no snapshot for {source_id} in {self.url}"
        try:
            data = json.loads(got[0])
        except UnicodeDecodeError:
            return None, f"snapshot {source_id}: manifest.json is not UTF-8 JSON"
        except ValueError as exc:
            return None, f"snapshot {source_id}: manifest.json is not valid JSON ({str(exc).splitlines()[0]})"
        why = _validate_manifest(data, source_id)
        if why:
            return None, f"snapshot {source_id}: {why}"
        return Snapshot(source_id, self.path_of(self.key(source_id)), data), ""

    def _sizes(self, source_id: str) -> dict[str, int]:
        base = self.key(source_id) + "/"
        return {o["Key"][len(base):]: int(o["Size"]) for o in self.objects(base)}

    @staticmethod
    def _check(sizes: dict[str, int], rel: str, size: int) -> Optional[str]:
        if rel not in sizes:
            return f"{rel} is missing"
        if sizes[rel] != size:
            return f"{rel} is {sizes[rel]} bytes, the manifest says {size}"
        return None

    def _file_checker(self, source_id: str, snap: Snapshot) -> Callable[[str, int], Optional[str]]:
        sizes = self._sizes(source_id)  # one listing for every file
        return lambda rel, size: self._check(sizes, rel, size)

    def _file_xxh3(self, source_id: str, snap: Snapshot, rel: str) -> str:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        digest = xxhash.xxh3_128()
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self.key(source_id, rel))["Body"]
            for block in body.iter_chunks(8 << 20):
                digest.update(block)
        except (BotoCoreError, ClientError) as exc:
            raise OSError(f"cannot be read back from the bucket ({exc})") from exc
        return digest.hexdigest()

    def list(self) -> list[StoreEntry]:  # noqa: A003 — Store's name
        """Every snapshot under the prefix with its status (ok / claimed / incomplete / refused)."""
        entries = []
        for sid in sorted(self.children(self.prefix)):
            if sid.startswith(".") or sid == "kernel-cache" or not valid_id(sid):
                continue
            objs = list(self.objects(self.key(sid) + "/"))
            manifest_obj = next((o for o in objs if o["Key"] == self.key(sid, MANIFEST)), None)
            found, why = self.lookup(sid)
            holder = self._holder(sid)
            if found:
                status, size, manifest = "ok", found.total_bytes, found.manifest
            else:
                snap, _ = self._load(sid)
                manifest = snap.manifest if snap else None
                status = "claimed" if holder else ("refused" if manifest_obj is not None else "incomplete")
                size = sum(int(o["Size"]) for o in objs)
            used = manifest_obj["LastModified"].timestamp() if manifest_obj is not None else None
            entries.append(StoreEntry(sid, status, why, size, manifest, holder, used))
        return entries

    def stage_job(self, items: list, dest: Path, **kw: Any) -> Any:
        """A job that stages `items` (their `src`: `path_of` keys) into `dest` (staging/s3_stage.py)."""
        from mxlaunch.staging.s3_stage import S3StageJob  # noqa: PLC0415

        return S3StageJob(self, items, dest, **kw)

    # ---- writing ----

    def capture_spool(self, run_id: str) -> Optional[Path]:
        return self.root / ".spool" / run_id

    def begin_capture(self, source_id: str, meta: SnapshotMeta, *, nranks: int, nnodes: int = 1, node_rank: int = 0,
                      ranks: Optional[Iterable[int]] = None, capture_id: Optional[str] = None) -> Any:
        """This node's part of a capture: written node-locally, uploaded by `S3CaptureWriter.upload_copy`."""
        from mxlaunch.store.s3_capture import S3CaptureWriter  # noqa: PLC0415

        folder = self.folder(source_id)
        my_ranks, capture_id = node_part(nranks, nnodes, node_rank, ranks, capture_id)
        if self._published_capture(source_id) is not None:
            raise CheckFailed(f"snapshot {source_id} is already published", "look it up instead of capturing")
        tmp = node_tmp(ensure_dir(folder), capture_id)
        writer = S3CaptureWriter(self, source_id, meta, nranks, nnodes, node_rank, my_ranks, capture_id, tmp)
        for rank in my_ranks:
            writer.rank_dir(rank)
        return writer

    def remove(self, source_id: str, force: bool = False) -> None:
        """Remove a snapshot: its manifest first (gone at once for planners), then every object under it."""
        if not self.exists(source_id):
            raise UsageError(f"no snapshot {source_id} in {self.url}", "see `mxlaunch store list`")
        holder = self._holder(source_id)
        if holder is not None and not force:
            raise CheckFailed(f"snapshot {source_id} is claimed by {holder.describe()}",
                              "wait for the capture to finish, or pass --force")
        self.s3.delete_object(Bucket=self.bucket, Key=self.key(source_id, MANIFEST))
        self.delete_prefix(self.key(source_id) + "/")

    def _holder(self, source_id: str) -> Optional[ClaimInfo]:
        try:
            return self.coordinator.holder(source_id)
        except Exception:  # noqa: BLE001
            return None

    def total_bytes(self) -> int:
        return sum(int(o["Size"]) for o in self.objects(self.prefix + "/" if self.prefix else ""))

    def prune(self, *, unused_for: Optional[float] = None, max_bytes: Optional[int] = None,
              dry_run: bool = False, now: Optional[float] = None) -> Any:
        """`store prune` on the bucket (store/s3_prune.py)."""
        from mxlaunch.store.s3_prune import prune  # noqa: PLC0415

        return prune(self, unused_for=unused_for, max_bytes=max_bytes, dry_run=dry_run, now=now)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

