"""A capture written through /dev/shm, uploaded into the store (a mixin of launch/capture.py's CaptureSession,
whose state it reads and whose `_node_done` / `_give_up` it calls).

**Through /dev/shm.** When the plan routes the capture through node-local /dev/shm (`capture_via` "shm",
launch/capture_route.py), the plugin writes into `local_root/<rank>/` in the run folder instead of the
store. Once every capturing worker of this node has reported and the engine is ready (at once in a
capture over several nodes: the holder's wait runs from its own part), the files are uploaded into the
store's temp folder in background threads (staging/upload.py, checksummed on the way); only then is
the node's part done as in launch/capture.py. A failed upload gives the capture up like any failed capture; the
/dev/shm copy goes once uploaded, on a failure, and with the run folder on every exit. A launch that
stops (signal, engine exit) while its upload runs cancels it and gives the capture up: the stop stays
within the scheduler's grace and the next launch captures again.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from mxlaunch.errors import MxlaunchError
from mxlaunch.fileutil import ensure_dir
from mxlaunch.staging.capacity import format_bytes
from mxlaunch.staging.upload import UploadItem, UploadJob, copy_file
from mxlaunch.store.snapshot import check_relpath

PROGRESS_S = 10.0  # an upload's progress line, this often


class CaptureUpload:
    """The upload from /dev/shm: started once every rank is in and the engine serves, polled by the session's
    `poll`, cancelled by `stop_upload`."""

    state: str
    writer: Any
    local_root: Optional[Path]
    copy: Optional[Callable[..., tuple[int, str]]]
    upload: Optional[UploadJob]
    ready: bool
    upload_at_once: bool
    holder: bool
    claim: Any
    part: Any  # launch/capture_part.py's CapturePart
    sid: str
    keep_root: Optional[Path]
    kept: bool
    store: Any
    emit: Callable[..., None]
    _next_progress: float

    # ---- the upload from /dev/shm ----

    def _start_upload(self) -> None:
        """Once every rank is in /dev/shm and the engine serves (at once over several nodes, or for
        --capture-only, which stops the engine when the snapshot is published)."""
        if (self.state != "uploading" or self.upload is not None
                or not (self.ready or self.multinode or self.upload_at_once)):
            return
        assert self.writer is not None and self.local_root is not None
        items = []
        try:
            for rank in self.part.ranks:
                base, dest = self.local_root / str(rank), self.writer.rank_dir(rank)
                for path in sorted(base.rglob("*")):
                    inner = path.relative_to(base)
                    if (not path.is_file() or path.is_symlink() or check_relpath(str(inner)) is not None
                            or any(p.startswith(".") for p in inner.parts)):
                        continue  # a temp or foreign file: never recorded, so never uploaded
                    ensure_dir((dest / inner).parent)
                    items.append(UploadItem(rank, str(inner), path, dest / inner, path.stat().st_size))
        except (OSError, MxlaunchError) as exc:
            return self._upload_failed(getattr(exc, "message", None) or str(exc))
        upload = getattr(self.writer, "upload_copy", None)  # an S3 store's writer uploads into the bucket
        self.upload = UploadJob(items, copy=self.copy or upload or copy_file).start()
        self._next_progress = time.monotonic() + PROGRESS_S
        self.emit("upload", ranks=self.part.ranks, bytes=self.upload.total_bytes, files=len(items),
                  source=str(self.local_root),
                  message=f"uploading snapshot rank(s) {self.part.ranks} ({format_bytes(self.upload.total_bytes)}, "
                          f"{len(items)} files) from /dev/shm into the store in the background")

    def _poll_upload(self, now: float) -> None:
        job = self.upload
        if job is None:
            return
        if job.running:
            if self.holder and self.claim is not None and self.claim.lost:
                return self._give_up("the capture claim was lost (its lease ran out) during the upload")
            if now >= self._next_progress:
                self._next_progress = now + PROGRESS_S
                rate = job.done_bytes / max(job.seconds, 1e-9) / (1 << 30)
                self.emit("upload", ranks=self.part.ranks, bytes=job.total_bytes, done=job.done_bytes,
                          message=f"uploaded {format_bytes(job.done_bytes)} of {format_bytes(job.total_bytes)} "
                                  f"({rate:.2f} GiB/s)")
            return
        if job.error is not None:
            return self._upload_failed(job.error)
        if not job.ok:  # cancelled: this node is stopping
            return self._give_up("this node stopped before its upload from /dev/shm into the store was done")
        assert self.writer is not None
        try:
            for done in sorted(job.results.values(), key=lambda u: (u.rank, u.rel)):
                self.writer.add_file(done.rank, done.rel, xxh3_128=done.xxh3_128)
        except (OSError, MxlaunchError) as exc:
            return self._upload_failed(getattr(exc, "message", None) or str(exc))
        self._keep_local(job)
        self._drop_local()
        self.emit("uploaded", ranks=self.part.ranks, bytes=job.total_bytes, seconds=round(job.seconds, 3),
                  gib_per_s=round(job.total_bytes / max(job.seconds, 1e-9) / (1 << 30), 3))
        self._node_done(recorded=True)

    def _upload_failed(self, why: str) -> None:
        root = getattr(self.store, "url", self.store.root)
        self._give_up(f"uploading snapshot rank(s) {self.part.ranks} from /dev/shm into the store failed: {why}",
                      fix=f"check free space, quota and permissions on {root} (or set MXLAUNCH_CAPTURE_VIA_SHM=off "
                          "to write straight into the store)")

    def stop_upload(self, timeout: float = 5.0) -> None:
        """Cancel a running upload and wait for its threads a moment (before the run folder goes)."""
        if self.upload is not None and self.upload.running:
            self.upload.cancel()
            self.upload.join(timeout)

    def _keep_local(self, job: UploadJob) -> None:
        """`--keep-staged`: the uploaded /dev/shm copy stays as this snapshot's kept files (staging/kept.py), so a
        restart right after the first serve links them instead of staging the store's copy. Each file is
        recorded with the checksum the upload took while reading it: the one the manifest now holds."""
        if self.keep_root is None or self.local_root is None:
            return
        from mxlaunch.staging import kept

        expected = {f"{u.rank}/{u.rel}": {"bytes": u.bytes, "xxh3_128": u.xxh3_128} for u in job.results.values()}
        try:
            total = kept.keep(self.keep_root, self.sid, self.local_root, expected)
        except (MxlaunchError, OSError) as exc:
            self.emit("kept", status="failed", reason=getattr(exc, "message", None) or str(exc))
            return
        self.kept = True
        self.emit("kept", status="kept", ranks=self.part.ranks, bytes=total,
                  message="the capture's /dev/shm copy stays for the next launch of this snapshot on this node "
                          "(mxlaunch kept --drop frees it)")

    def _drop_kept(self) -> None:
        if self.kept and self.keep_root is not None:
            from mxlaunch.staging import kept

            kept.drop(self.keep_root, self.sid)
            self.kept = False

    def _drop_local(self) -> None:
        """The /dev/shm copy: gone once uploaded, or given up (the run folder's removal catches the rest)."""
        if self.local_root is not None:
            shutil.rmtree(self.local_root, ignore_errors=True)
