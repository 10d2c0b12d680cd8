"""A model in an S3 bucket (`s3://bucket/prefix`, the form vLLM's runai_streamer takes), downloaded once per
artifact store into the store's model folder and then served from there like any local model folder.

boto3 lists the prefix and signs one GET URL per object; the bytes come over plain HTTP with parallel ranged
GETs (remote/ranged.py: per-chunk retries, resume, `.incomplete` until checked), under the store's claim so
that N launchers of a new model download it once (remote/fetch.py `once_per_store`). Endpoint and
credentials are boto3's own: `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`, `AWS_PROFILE`, `AWS_ACCESS_KEY_ID`
and the rest of its chain.

Layout (in the store):

    <store>/.models/s3/<bucket>/<prefix>/<version>/<key below the prefix>  each file renamed in once checked
    <store>/.models/s3/<bucket>/<prefix>/<version>/.complete                 written last: the folder is whole

`<version>` digests the listing (every key, size and ETag): an object changed in the bucket is a new folder,
never a file swapped under a running engine. Each file is checked by its size, and by its content when the
bucket says how: the object's SHA-256 checksum (single-part uploads with checksums), else its ETag when that
is the MD5 of the bytes (single-part, not KMS- or customer-key-encrypted); otherwise by size only, and the
download says so.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import httpx
import xxhash

from mxlaunch.errors import UsageError
from mxlaunch.fileutil import write_json_atomic
from mxlaunch.remote.fetch import DOWNLOADS, Emit, Fetched, once_per_store
from mxlaunch.remote.ranged import CHUNK, WORKERS, Target, check_room, download
from mxlaunch.store.core import Store

SCHEME = "s3://"
URL_TTL_S = 6 * 3600  # presigned GETs outlive the longest download
COMPLETE = ".complete"
MODELS = ".models"  # a dot folder: store list and prune (snapshot folders) never take it for a snapshot
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_MD5 = re.compile(r"^[0-9a-f]{32}$")


def is_s3_url(model: str) -> bool:
    return model.startswith(SCHEME)


def parse_url(url: str) -> tuple[str, str]:
    """s3://bucket/prefix → (bucket, prefix without slashes at its ends); one line for what is wrong."""
    rest = url[len(SCHEME):] if is_s3_url(url) else ""
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket) or not prefix or any(p in ("", ".", "..") for p in prefix.split("/")):
        raise UsageError(f"{url!r} is not an S3 model folder", "give it as s3://bucket/path/to/model")
    return bucket, prefix


@dataclass(frozen=True)
class S3File:
    """One object below the prefix: its path in the model folder, size, and what its content is checked by."""

    path: str
    key: str
    size: int
    etag: str
    sha256: Optional[str] = None  # hex, from the object's own checksum
    md5: Optional[str] = None  # hex, when the ETag is the MD5 of the bytes

    def check(self, path: Path) -> Optional[str]:
        size = path.stat().st_size
        if size != self.size:
            return f"{size} bytes, the bucket says {self.size}"
        if self.sha256 or self.md5:
            h = hashlib.sha256() if self.sha256 else hashlib.md5()  # noqa: S324 — the bucket's own ETag is an MD5
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(4 << 20), b""):
                    h.update(block)
            want = self.sha256 or self.md5
            if h.hexdigest() != want:
                return f"{'sha256' if self.sha256 else 'md5'} {h.hexdigest()}, the bucket says {want}"
        return None


@dataclass(frozen=True)
class S3Model:
    bucket: str
    prefix: str
    files: tuple[S3File, ...]

    @property
    def version(self) -> str:
        listing = "\n".join(f"{f.key}\0{f.size}\0{f.etag}" for f in self.files)
        return xxhash.xxh3_64_hexdigest(f"{self.bucket}\0{self.prefix}\0{listing}".encode())

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def checked_by_size_only(self) -> int:
        return sum(1 for f in self.files if not (f.sha256 or f.md5))


def client(environ: Mapping[str, str] = os.environ) -> Any:
    """A boto3 S3 client as boto3 configures it (the environment, profiles, instance roles)."""
    try:
        import boto3  # noqa: PLC0415 — an extra: only S3 models need it
        from botocore.config import Config  # noqa: PLC0415
    except ImportError:
        raise UsageError("an s3:// model needs boto3, which is not installed",
                         "pip install 'mxlaunch[s3]' (or boto3) where mxlaunch runs") from None
    endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None
    keys = {"aws_access_key_id": environ.get("AWS_ACCESS_KEY_ID"), "aws_secret_access_key": environ.get("AWS_SECRET_ACCESS_KEY"),
            "aws_session_token": environ.get("AWS_SESSION_TOKEN"),
            "region_name": environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")}
    # the environment given wins (the launcher's own by default); profiles and roles are boto3's chain after it
    session = boto3.session.Session(profile_name=environ.get("AWS_PROFILE") or None,
                                    **{k: v for k, v in keys.items() if v})
    return session.client("s3", endpoint_url=endpoint,
                          config=Config(signature_version="s3v4", retries={"max_attempts": 3, "mode": "standard"}))


def refusal(exc: BaseException, subject: str, *, may: str = "list and read") -> UsageError:
    """boto3's errors as one line each (what is wrong — what to do); `subject` names what was asked for (a model
    folder's URL, "the artifact store s3://…"), `may` what its credentials must be allowed to do."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError  # noqa: PLC0415

    if isinstance(exc, NoCredentialsError):
        return UsageError(f"no S3 credentials for {subject}",
                          "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, for the bucket's account")
    if isinstance(exc, EndpointConnectionError):
        return UsageError(f"cannot reach the S3 endpoint of {subject} ({exc})", "check AWS_ENDPOINT_URL and the network")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchBucket", "404"):
            return UsageError(f"the bucket of {subject} does not exist",
                              "check the bucket's name (and AWS_ENDPOINT_URL), or create the bucket")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return UsageError(f"S3 refused {subject} ({code})",
                              f"use credentials that may {may} the prefix (AWS_PROFILE or AWS_ACCESS_KEY_ID)")
        return UsageError(f"S3 answered {code or 'an error'} for {subject}", "check the URL and AWS_ENDPOINT_URL")
    return UsageError(f"cannot use {subject} ({type(exc).__name__}: {exc})",
                      "check the URL, the credentials and AWS_ENDPOINT_URL")


def list_model(s3: Any, url: str) -> S3Model:
    """Every object below the prefix (folder markers left out), with what each is checked by."""
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

    bucket, prefix = parse_url(url)
    found: list[dict] = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            found.extend(o for o in page.get("Contents", []) if not o["Key"].endswith("/"))
    except (BotoCoreError, ClientError) as exc:
        raise refusal(exc, url) from None
    if not found:
        raise UsageError(f"no objects below {url}", "check the path: it must name the model's folder (config.json inside)")
    if not any(o["Key"] == f"{prefix}/config.json" for o in found):
        raise UsageError(f"{url} holds no config.json", "give the model's own folder (where config.json is)")

    def described(o: dict) -> S3File:
        etag = str(o.get("ETag", "")).strip('"')
        rel = o["Key"][len(prefix) + 1:]
        if any(p in ("", ".", "..") for p in rel.split("/")):
            raise UsageError(f"{url} holds an object named {o['Key']!r}", "rename it: mxlaunch will not write outside the folder")
        try:
            head = s3.head_object(Bucket=bucket, Key=o["Key"], ChecksumMode="ENABLED")
        except (BotoCoreError, ClientError) as exc:
            raise refusal(exc, url) from None
        sha = head.get("ChecksumSHA256")
        sha_hex = base64.b64decode(sha).hex() if sha and "-" not in sha else None
        plain = head.get("ServerSideEncryption") not in ("aws:kms", "aws:kms:dsse") and not head.get("SSECustomerAlgorithm")
        md5 = etag if _MD5.match(etag) and plain else None
        return S3File(rel, o["Key"], int(o["Size"]), etag, sha_hex, md5)

    with ThreadPoolExecutor(8) as pool:
        files = tuple(sorted(pool.map(described, found), key=lambda f: f.path))
    return S3Model(bucket, prefix, files)


def model_dir(store: Store, model: S3Model) -> Path:
    return store.root / MODELS / "s3" / model.bucket / model.prefix / model.version


def ensure_model(url: str, store: Store, emit: Emit, *, environ: Mapping[str, str] = os.environ,
                 workers: int = WORKERS, chunk: int = CHUNK, poll_s: float = 0.5,
                 on_bytes: Callable[[int, int], None] = lambda done, total: None) -> Fetched:
    """The model's folder in the store, downloading it once per store (`commit`: the listing's version)."""
    t0 = time.monotonic()
    s3 = client(environ)
    model = list_model(s3, url)
    folder = model_dir(store, model)
    if (folder / COMPLETE).is_file():
        return Fetched(folder, model.version, "cached", 0, time.monotonic() - t0)
    key = "s3-" + model.version
    progress_file = store.root / DOWNLOADS / f"{key}.json"

    def fetch(cancelled: Callable[[], bool]) -> int:
        return _download(s3, model, folder, url, progress_file, emit, workers, chunk, on_bytes, cancelled)

    by, got = once_per_store(store, key, done=lambda: (folder / COMPLETE).is_file(), fetch=fetch, emit=emit,
                             waiting=f"another launcher downloads {url} into {folder}: waiting for it",
                             extra={"model": url, "version": model.version}, progress_file=progress_file,
                             total=model.total_bytes, poll_s=poll_s, on_bytes=on_bytes)
    return Fetched(folder, model.version, by, got, time.monotonic() - t0)


def _download(s3: Any, model: S3Model, folder: Path, url: str, progress_file: Path, emit: Emit, workers: int,
              chunk: int, on_bytes: Callable[[int, int], None], cancelled: Callable[[], bool]) -> int:
    total = model.total_bytes
    size_only = model.checked_by_size_only
    done, last, t0, lock = [0], [0.0], time.monotonic(), threading.Lock()

    def progress(n: int) -> None:  # called from every download worker
        with lock:
            done[0] += n
            now = time.monotonic()
            if now - last[0] >= 1.0:
                last[0] = now
                write_json_atomic(progress_file, {"model": url, "done": done[0], "total": total, "pid": os.getpid()},
                                  parents=True)
                on_bytes(done[0], total)

    targets = []
    for f in model.files:
        dest = folder / f.path
        if dest.is_file() and dest.stat().st_size == f.size:
            continue  # checked when it was renamed in (an earlier, interrupted download)
        signed = s3.generate_presigned_url("get_object", Params={"Bucket": model.bucket, "Key": f.key},
                                           ExpiresIn=URL_TTL_S)
        targets.append(Target(signed, dest, f.size, f.check,
                              refused_fix="check the credentials' read access to the bucket (or AWS_ENDPOINT_URL), "
                                          "then run the launch again: it resumes", direct=True))
    check_room(targets, chunk)  # before a word of it: a disk without room is the one line
    emit("download", status="start", model=url, version=model.version, files=len(model.files), bytes=total,
         dir=str(folder), message=f"downloading {len(model.files)} file(s) of {url} ({total / (1 << 30):.2f} GiB) "
         f"with {workers} parallel ranged GETs; other launchers on this store wait for it"
         + (f"; {size_only} file(s) checked by size only (the bucket gives no content hash for them)" if size_only else ""))
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0),
                      limits=httpx.Limits(max_connections=workers + 2, max_keepalive_connections=workers + 2)) as http:
        try:
            got = download(http, targets, chunk=chunk, workers=workers, progress=progress, cancelled=cancelled)
        finally:
            progress_file.unlink(missing_ok=True)
    (folder / COMPLETE).write_text(model.version + "\n")
    seconds = time.monotonic() - t0
    on_bytes(total, total)
    emit("download", status="done", model=url, version=model.version, bytes=got, seconds=round(seconds, 3),
         gib_per_s=round(got / max(seconds, 1e-9) / (1 << 30), 3))
    return got
