"""Staging a snapshot from an S3 store into /dev/shm: parallel ranged GETs, each file renamed in when checked.

The launcher's staged restore with `--artifact-path s3://…` (store/s3_store.py): boto3 signs one GET URL
per object and remote/ranged.py fetches it in chunks over `workers` connections, written in place into
`<dest>.incomplete`; the file is checked against the manifest (size, then xxh3-128 of the bytes in
/dev/shm) and only then renamed to its final name — the in-engine loader's per-file readiness works as
with a local store. One pool of connections takes every file's chunks in rank and file order, and a file is
renamed in as soon as its last chunk lands (the first rank's files are whole soonest, and no connection
idles at a file's end waiting for the file's slowest chunk). A dropped connection is retried per chunk (ranged.TRIES); a chunk that
keeps failing, a wrong checksum, a cancel: the job fails and removes every file it made, so the engine
falls back to its default loader and the next launch stages afresh.

The interface is staging/reader.py's `StageJob` as the launcher drives it: start, wait, cancel, finished.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import httpx
import xxhash

from mxlaunch.errors import CheckFailed, MxlaunchError, UsageError
from mxlaunch.remote.ranged import CHUNK, WORKERS, DownloadCancelled, Target, download
from mxlaunch.staging.capacity import capacity_of, format_bytes, tmpfs_pager
from mxlaunch.staging.records import StageCancelled, StagedFile, StageResult
from mxlaunch.staging.sources import CopyItem
from mxlaunch.store.snapshot import xxh3_file

if TYPE_CHECKING:
    from mxlaunch.store.s3_store import S3Store

URL_TTL_S = 6 * 3600


class S3StageJob:
    """Fetch `items` (src: the store's `path_of` keys; rel: the path under `dest`) into `dest`."""

    def __init__(self, store: "S3Store", items: list[CopyItem], dest: Path, *, expected: dict[str, dict],
                 reserve_bytes: int = 0, workers: int = WORKERS, chunk: int = CHUNK) -> None:
        self.store = store
        self.items = sorted(items, key=lambda i: i.rel)
        self.dest = Path(dest)
        self.expected = expected
        self.reserve_bytes = reserve_bytes
        self.workers = max(1, workers)
        self.chunk = chunk
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._files: list[StagedFile] = []
        self._made: list[Path] = []
        self._huge: tuple[int, Optional[str]] = (0, None)  # bytes in 2 MiB pages, why not (more)
        self._t0 = 0.0
        self._seconds = 0.0
        self._thread: Optional[threading.Thread] = None

    def total_bytes(self) -> int:
        return sum(i.size for i in self.items)

    def preflight(self) -> None:
        for item in self.items:
            final = self.dest / item.rel
            if final.exists() or final.with_name(final.name + ".incomplete").exists():
                raise UsageError(f"{final} already exists", "remove it and retry")
            entry = self.expected.get(item.rel)
            if entry is None or int(entry.get("bytes", -1)) != item.size:
                raise CheckFailed(f"{item.rel} does not match the manifest", "plan the launch again")
        self.dest.mkdir(parents=True, exist_ok=True)
        cap = capacity_of(self.dest)
        need = self.total_bytes() + self.reserve_bytes
        if need > cap.usable:
            raise UsageError(f"staging needs {format_bytes(self.total_bytes())} but {cap.binding_limit} leaves "
                             f"{format_bytes(cap.usable)}", "free space, raise the job's memory limit, or stage elsewhere")

    def start(self) -> "S3StageJob":
        self.preflight()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="mx-s3-stage", daemon=True)
        self._thread.start()
        return self

    def _target(self, item: CopyItem) -> Target:
        want = self.expected[item.rel]
        url = self.store.s3.generate_presigned_url("get_object", Params={"Bucket": self.store.bucket,
                                                                         "Key": self.store.key_of(item.src)},
                                                   ExpiresIn=URL_TTL_S)

        def check(path: Path) -> Optional[str]:
            size = path.stat().st_size
            if size != item.size:
                return f"{size} bytes, the manifest says {item.size}"
            return verdict(xxh3_file(path))

        def check_view(view: memoryview) -> Optional[str]:  # the mapping the bytes landed in: no read-back
            return verdict(xxhash.xxh3_128(view).hexdigest())

        def verdict(digest: str) -> Optional[str]:
            return None if digest == want.get("xxh3_128") else f"xxh3_128 {digest}, the manifest says {want.get('xxh3_128')}"

        return Target(url, self.dest / item.rel, item.size, check,
                      refused_fix="check the credentials' read access to the store's bucket (or AWS_ENDPOINT_URL)",
                      direct=True, check_view=check_view)

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0),
                              limits=httpx.Limits(max_connections=self.workers + 2,
                                                  max_keepalive_connections=self.workers + 2)) as http:
                # One pool for every file, chunks taken in file order, each file renamed in as its last chunk
                # lands: the connections never idle at a file's end, and the loader still gets file after file.
                targets = [self._target(item) for item in self.items]
                by_dest = {t.dest: item for t, item in zip(targets, self.items)}
                for t in targets:
                    self._made += [t.dest, t.partial, t.chunks_file]

                def landed(t: Target) -> None:
                    item = by_dest[t.dest]
                    self._files.append(StagedFile(item.src, t.dest, item.rel, item.size, time.perf_counter() - self._t0,
                                                  False, self.expected[item.rel].get("xxh3_128")))

                pager = tmpfs_pager(self.dest, lands_in_mapping=True)  # 2 MiB pages while cheaper than 4 KiB ones
                download(http, targets, chunk=self.chunk, workers=self.workers, cancelled=self._cancel.is_set,
                         on_file=landed, pager=pager)
                if pager is not None:
                    self._huge = (pager.collapsed, pager.reason)
        except DownloadCancelled:
            self._error = StageCancelled("staging from S3 was cancelled")
            self._remove()
        except BaseException as exc:  # noqa: BLE001 — reported by wait(); nothing partial stays
            self._error = exc
            self._remove()
        finally:
            self._seconds = time.perf_counter() - self._t0
            self._done.set()

    def _remove(self) -> None:
        for path in self._made:
            try:
                path.unlink()
            except OSError:
                pass
        for folder in sorted({p.parent for p in self._made}, key=lambda p: -len(p.parts)):
            while folder != self.dest.parent and folder.is_dir():
                try:
                    folder.rmdir()
                except OSError:
                    break
                folder = folder.parent

    def cancel(self) -> None:
        self._cancel.set()

    def finished(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def wait(self, poll: float = 0.2) -> StageResult:
        while not self._done.wait(poll):
            pass
        if self._error is not None:
            err = self._error
            if isinstance(err, MxlaunchError):
                raise err
            raise CheckFailed(f"staging from {self.store.url} failed ({type(err).__name__}: {err})",
                              "the engine loads with its default loader; check the store with `mxlaunch store verify`")
        total = sum(f.bytes for f in self._files)
        return StageResult(list(self._files), total, self._seconds, self.workers, self.chunk, False,
                           huge_bytes=self._huge[0], huge_note=self._huge[1])

    def __repr__(self) -> str:  # pragma: no cover
        return f"S3StageJob({len(self.items)} files → {self.dest})"
