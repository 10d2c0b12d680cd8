"""Writing a snapshot: a node's capture folder, its ranks, its completion marker, the publish (see store.py)."""

from __future__ import annotations

import getpass
import os
import secrets
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from mxlaunch.fileutil import ensure_dir, secure, write_json_atomic
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.store_snapshot import _HEX32, SCHEMA, SnapshotFile, SnapshotMeta, check_relpath, xxh3_file

if TYPE_CHECKING:  # the Store hands itself to the writer it creates
    from mxlaunch.store import Store


class CaptureWriter:
    """This node's part of one capture: a temp folder per node, rank folders moved into place when done."""

    def __init__(self, store: Store, source_id: str, meta: SnapshotMeta, nranks: int, nnodes: int,
                 node_rank: int, ranks: list[int], capture_id: str, tmp: Path) -> None:
        self.store = store
        self.source_id = source_id
        self.meta = meta
        self.nranks = nranks
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.ranks = ranks
        self.capture_id = capture_id
        self.tmp = tmp
        self.files: dict[int, dict[str, dict[str, Any]]] = {r: {} for r in ranks}
        self.done = False

    @property
    def folder(self) -> Path:
        return self.store.root / self.source_id

    @property
    def capture_dir(self) -> Path:
        """The plan's `capture_dir`: rank R writes `<capture_dir>/<R>/*.safetensors` (= rank_dir(R))."""
        return self.tmp / "ranks"

    def rank_dir(self, rank: int) -> Path:
        """The temp folder where `rank` writes its files (created on first use)."""
        self._own(rank)
        return ensure_dir(self.tmp / "ranks" / str(rank))

    def add_file(self, rank: int, relpath: str, *, xxh3_128: Optional[str] = None) -> SnapshotFile:
        """Record a finished file of `rank` (relative to its rank_dir): size and checksum (computed unless given)."""
        self._own(rank)
        why = check_relpath(relpath)
        if why:
            raise UsageError(f"rank {rank}: {why}", "write .safetensors or .json files inside rank_dir()")
        path = self.tmp / "ranks" / str(rank) / relpath
        try:
            st: Optional[os.stat_result] = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise CheckFailed(f"rank {rank}: {relpath} is not a regular file in {path.parent}", "write it before adding it")
        secure(path, is_dir=False)
        digest = xxh3_128 or xxh3_file(path)
        if not _HEX32.match(digest):
            raise UsageError(f"rank {rank}: {relpath}: {digest!r} is not an xxh3_128 hex digest", "pass hexdigest()")
        final_rel = f"data-{self.capture_id}/ranks/{rank}/{relpath}"
        self.files[rank][relpath] = {"path": final_rel, "bytes": st.st_size, "xxh3_128": digest}
        return SnapshotFile(self.folder / final_rel, st.st_size, digest)

    def add_rank_dir(self, rank: int) -> list[SnapshotFile]:
        """Record every .safetensors / .json file under rank_dir(rank) (other files are left out)."""
        base = self.rank_dir(rank)
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                rel = str(Path(dirpath, name).relative_to(base))
                if check_relpath(rel) is None:
                    out.append(self.add_file(rank, rel))
        return out

    def mark_node_done(self) -> bool:
        """Move this node's ranks into place and write its marker; publish when the set is complete.

        Returns True only when this call published the manifest (exactly one node does)."""
        if self.done:
            raise UsageError("mark_node_done() was already called for this capture", "call it once per node")
        empty = [r for r in self.ranks if not self.files[r]]
        if empty:
            raise CheckFailed(f"capture of {self.source_id}: rank {empty[0]} has no files", "write every rank before marking the node done")
        data = ensure_dir(self.folder / f"data-{self.capture_id}" / "ranks")
        for rank in self.ranks:
            try:
                os.rename(self.tmp / "ranks" / str(rank), data / str(rank))
            except OSError as exc:
                raise CheckFailed(f"capture {self.capture_id} of {self.source_id}: rank {rank} is already in place "
                                  f"or cannot be moved ({exc.strerror})", "start a new capture") from exc
        markers = ensure_dir(self.folder / f".nodes-{self.capture_id}")
        marker = {
            "schema": SCHEMA, "capture_id": self.capture_id, "node_rank": self.node_rank, "host": socket.gethostname(),
            "ranks": [{"rank": r, "files": [self.files[r][k] for k in sorted(self.files[r])]} for r in self.ranks],
        }
        write_json_atomic(markers / f"{self.node_rank}.json", marker)
        self.done = True
        shutil.rmtree(self.tmp, ignore_errors=True)
        return self.store.try_publish(self.source_id, self.capture_id, self.meta, self.nranks, self.nnodes)

    def abort(self) -> None:
        """Drop this node's temp folder (its unpublished work)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _own(self, rank: int) -> None:
        if rank not in self.files:
            raise UsageError(f"rank {rank} is not one of this node's ranks {self.ranks}", "check the plan")

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None or not self.done:
            self.abort()


def new_capture_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return str(os.getuid())


def _du(folder: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
