"""Writing a snapshot into an S3 store: a node's capture, uploaded file by file, then its marker (store/s3_store.py).

The plugin writes each rank's files node-locally (the run folder in /dev/shm, else the store's
`capture_spool`, a folder on the node's disk); once the engine is ready the launcher's UploadJob
(staging/upload.py, launch/capture_upload.py) calls `upload_copy` for each file instead of a local copy: the
file is read once, in parts, each part hashed into the file's xxh3-128 (the manifest's checksum, of the
very bytes sent) and uploaded as one part of a multipart upload, `PARALLEL` parts in flight. The object
appears only when the upload completes; a failure or a cancel aborts it, so no half-written object is
ever visible. Whole objects of a capture that never publishes are removed by the claim holder's
`discard_capture`, or by the next holder's `reap_captures`, or by `store prune`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import xxhash

from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.staging.upload import UploadCancelled
from mxlaunch.store.capture import CaptureWriter
from mxlaunch.store.snapshot import _HEX32, SCHEMA, SnapshotFile, check_relpath

PART = 32 << 20  # multipart part size (S3: ≥ 5 MiB but the last, ≤ 10 000 parts: files up to 312 GiB)
PARALLEL = 8  # parts in flight per file


def upload_file(s3: Any, bucket: str, key: str, src: Path, *, part: int = PART, parallel: int = PARALLEL,
                progress: Callable[[int], None] = lambda n: None, cancelled: Callable[[], bool] = lambda: False) -> tuple[int, str]:
    """Upload `src` to s3://bucket/key; returns (bytes, xxh3-128 of the bytes sent). Multipart with
    `parallel` parts in flight above one part's size; aborted on any failure (UploadCancelled on cancel)."""
    size = src.stat().st_size
    while -(-size // part) > 10000:
        part *= 2
    digest = xxhash.xxh3_128()
    fd = os.open(src, os.O_RDONLY)
    try:
        if size <= part:
            data = os.pread(fd, size, 0) if size else b""
            if len(data) != size:
                raise OSError(f"{src} changed while it was uploaded")
            if cancelled():
                raise UploadCancelled(f"{src.name}: cancelled")
            digest.update(data)
            s3.put_object(Bucket=bucket, Key=key, Body=data)
            progress(size)
            return size, digest.hexdigest()
        upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        try:
            etags = _parts(s3, bucket, key, upload_id, fd, src, size, part, parallel, digest, progress, cancelled)
            if cancelled():  # up to the last moment: a completed upload is a visible object
                raise UploadCancelled(f"{src.name}: cancelled")
            s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                         MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in etags]})
        except BaseException:
            try:
                s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 — the capture's discard (or prune) aborts what is left
                pass
            raise
    finally:
        os.close(fd)
    head = s3.head_object(Bucket=bucket, Key=key)
    if int(head["ContentLength"]) != size:
        s3.delete_object(Bucket=bucket, Key=key)
        raise CheckFailed(f"s3://{bucket}/{key} has {head['ContentLength']} bytes after its upload, not {size}",
                          "the capture is given up; the next launch captures again")
    return size, digest.hexdigest()


def _parts(s3: Any, bucket: str, key: str, upload_id: str, fd: int, src: Path, size: int, part: int, parallel: int,
           digest: Any, progress: Callable[[int], None], cancelled: Callable[[], bool]) -> list[tuple[int, str]]:
    """Read the parts in order (hashing them), upload up to `parallel` at once; [(part number, ETag)]."""
    slots = threading.Semaphore(parallel)
    futures: list[Future] = []

    def send(number: int, data: bytes) -> tuple[int, str]:
        try:
            if cancelled():
                raise UploadCancelled(f"{src.name}: cancelled")
            etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)["ETag"]
            progress(len(data))
            return number, etag
        finally:
            slots.release()

    with ThreadPoolExecutor(parallel, thread_name_prefix="mx-s3-part") as pool:
        try:
            for number, offset in enumerate(range(0, size, part), start=1):
                want = min(part, size - offset)
                data = os.pread(fd, want, offset)
                if len(data) != want:
                    raise OSError(f"{src} changed while it was uploaded ({offset + len(data)} of {size} bytes)")
                digest.update(data)
                while not slots.acquire(timeout=0.5):  # a free slot, unless stopped or a part failed
                    _stop_early(futures, cancelled, src)
                _stop_early(futures, cancelled, src, holding=slots)
                futures.append(pool.submit(send, number, data))
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _stop_early(futures: list[Future], cancelled: Callable[[], bool], src: Path,
                holding: Optional[threading.Semaphore] = None) -> None:
    """Raise when the upload was cancelled or a part failed (giving back the slot held, if any)."""
    failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
    if failed is None and not cancelled():
        return
    if holding is not None:
        holding.release()
    raise failed if failed is not None else UploadCancelled(f"{src.name}: cancelled")


class S3CaptureWriter(CaptureWriter):
    """This node's part of one capture into an S3 store: local temp folders (`rank_dir`, only names for
    `upload_copy`'s destinations), objects under `data-<capture_id>/`, a marker in the bucket."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.uploaded: dict[tuple[int, str], tuple[int, str]] = {}
        self._lock = threading.Lock()

    def data_key(self, rank: int, rel: str) -> str:
        return self.store.key(self.source_id, f"data-{self.capture_id}", "ranks", str(rank), rel)

    def upload_copy(self, src: Path, dst: Path, *, chunk: int = PART, progress: Callable[[int], None] = lambda n: None,
                    cancelled: Callable[[], bool] = lambda: False) -> tuple[int, str]:
        """The UploadJob's copy: `dst` (under rank_dir) names the rank and file; the bytes go to the bucket."""
        inner = Path(dst).relative_to(self.tmp / "ranks")
        rank, rel = int(inner.parts[0]), "/".join(inner.parts[1:])
        self._own(rank)
        why = check_relpath(rel)
        if why:
            raise UsageError(f"rank {rank}: {why}", "write .safetensors or .json files inside rank_dir()")
        got = upload_file(self.store.s3, self.store.bucket, self.data_key(rank, rel), Path(src),
                          part=PART, progress=progress, cancelled=cancelled)
        with self._lock:
            self.uploaded[(rank, rel)] = got
        return got

    def add_file(self, rank: int, relpath: str, *, xxh3_128: Optional[str] = None) -> SnapshotFile:
        """Record an uploaded file; a file only written locally (into rank_dir) is uploaded now."""
        self._own(rank)
        why = check_relpath(relpath)
        if why:
            raise UsageError(f"rank {rank}: {why}", "write .safetensors or .json files inside rank_dir()")
        if (rank, relpath) not in self.uploaded:
            local = self.tmp / "ranks" / str(rank) / relpath
            if not local.is_file() or local.is_symlink():
                raise CheckFailed(f"rank {rank}: {relpath} was neither uploaded nor written in {local.parent}",
                                  "write it before adding it")
            self.upload_copy(local, local)
        size, digest = self.uploaded[(rank, relpath)]
        if xxh3_128 is not None and xxh3_128 != digest:
            raise CheckFailed(f"rank {rank}: {relpath} was uploaded with checksum {digest}, not {xxh3_128}",
                              "capture it again")
        if not _HEX32.match(digest):
            raise UsageError(f"rank {rank}: {relpath}: {digest!r} is not an xxh3_128 hex digest", "pass hexdigest()")
        final_rel = f"data-{self.capture_id}/ranks/{rank}/{relpath}"
        self.files[rank][relpath] = {"path": final_rel, "bytes": size, "xxh3_128": digest}
        return SnapshotFile(self.store.path_of(self.store.key(self.source_id, final_rel)), size, digest)

    def mark_node_done(self, publish: bool = True) -> bool:
        """Write this node's marker into the bucket; publish when every node's part is in (and `publish`)."""
        import socket  # noqa: PLC0415

        if self.done:
            raise UsageError("mark_node_done() was already called for this capture", "call it once per node")
        empty = [r for r in self.ranks if not self.files[r]]
        if empty:
            raise CheckFailed(f"capture of {self.source_id}: rank {empty[0]} has no files", "write every rank before marking the node done")
        marker = {
            "schema": SCHEMA, "capture_id": self.capture_id, "node_rank": self.node_rank, "host": socket.gethostname(),
            "ranks": [{"rank": r, "files": [self.files[r][k] for k in sorted(self.files[r])]} for r in self.ranks],
        }
        self.store.write_marker(self.source_id, self.capture_id, f"{self.node_rank}.json", marker)
        self.done = True
        self.abort()
        if not publish:
            return False
        return self.store.try_publish(self.source_id, self.capture_id, self.meta, self.nranks, self.nnodes)
