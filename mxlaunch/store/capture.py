"""Writing a snapshot: a node's capture folder, its ranks, its completion marker, the publish (see core.py),
and the bookkeeping of a capture spread over nodes: what they reported, and removing one that failed."""

from __future__ import annotations

import getpass
import os
import re
import secrets
import shutil
import socket
import stat
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

from mxlaunch.fileutil import ensure_dir, read_json, secure, write_json_atomic
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.store.snapshot import _HEX32, SCHEMA, SnapshotFile, SnapshotMeta, check_relpath, xxh3_file

if TYPE_CHECKING:  # the Store hands itself to the writer it creates
    from mxlaunch.store.core import Store


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

    def mark_node_done(self, publish: bool = True) -> bool:
        """Move this node's ranks into place and write its marker; publish when the set is complete
        (unless `publish` is False: then another node — the claim holder — publishes).

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
        self.abort()
        if not publish:
            return False
        return self.store.try_publish(self.source_id, self.capture_id, self.meta, self.nranks, self.nnodes)

    def publish(self) -> bool:
        """Publish if every node's part is in (the claim holder polls this); True only for the one winner."""
        return self.store.try_publish(self.source_id, self.capture_id, self.meta, self.nranks, self.nnodes)

    def abort(self) -> None:
        """Drop this node's temp folder (its unpublished work), and the capture's temp folder once empty."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            self.tmp.parent.rmdir()
        except OSError:
            pass  # another node's temp folder is still inside (or it is gone already)

    def _own(self, rank: int) -> None:
        if rank not in self.files:
            raise UsageError(f"rank {rank} is not one of this node's ranks {self.ranks}", "check the plan")

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None or not self.done:
            self.abort()


# ---- a capture spread over nodes ------------------------------------------------------------------------

_DONE = re.compile(r"^(0|[1-9][0-9]{0,5})\.json$")
_FAILED = re.compile(r"^(0|[1-9][0-9]{0,5})\.failed\.json$")
_PARTS = re.compile(r"^(data-|\.nodes-|\.tmp-)(.+)$")


def node_markers(markers_dir: Path) -> tuple[Optional[list[str]], list[str]]:
    """(the done markers' names — None when the folder does not exist —, the failed markers' names)."""
    try:
        names = sorted(os.listdir(markers_dir))
    except FileNotFoundError:
        return None, []
    return [n for n in names if _DONE.match(n)], [n for n in names if _FAILED.match(n)]


@dataclass
class PendingCapture:
    """What the nodes of one unpublished capture reported so far."""

    done: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)  # node → why it will not deliver its part

    @classmethod
    def read(cls, markers_dir: Path) -> "PendingCapture":
        done, failed = node_markers(markers_dir)
        out = cls(done={int(n.split(".")[0]) for n in done or []})
        for name in failed:
            try:
                data = read_json(markers_dir / name, limit=1 << 20)
                reason = str(data.get("reason", "no reason given")) if isinstance(data, dict) else "no reason given"
            except (OSError, ValueError):
                reason = "its marker cannot be read"
            out.failed[int(name.split(".")[0])] = reason
        return out


def write_failed(folder: Path, capture_id: str, node_rank: int, reason: str) -> None:
    markers = ensure_dir(folder / f".nodes-{capture_id}")
    write_json_atomic(markers / f"{node_rank}.failed.json",
                      {"schema": SCHEMA, "capture_id": capture_id, "node_rank": node_rank,
                       "host": socket.gethostname(), "reason": reason})


def discard_capture(folder: Path, capture_id: str, published: Optional[str]) -> bool:
    """Remove an unpublished capture: its markers first (renamed away, so no publisher finds a complete
    set any more), then its data and temp folders. Nothing when it is the published one (or the manifest
    cannot be read: `published` "?")."""
    if published is not None and (published == capture_id or published == "?"):
        return False
    removed = False
    for name in (f".nodes-{capture_id}", f"data-{capture_id}", f".tmp-{capture_id}"):
        path = folder / name
        trash = folder / f".trash-{secrets.token_hex(6)}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            continue
        except OSError:
            trash = path  # cannot rename (e.g. busy on NFS): remove it in place
        shutil.rmtree(trash, ignore_errors=True)
        removed = True
    return removed


def capture_ids(names: list[str]) -> set[str]:
    """The capture ids a snapshot folder's entries carry (data-, .nodes-, .tmp- folders)."""
    return {m.group(2) for m in map(_PARTS.match, names) if m}


def reap_captures(folder: Path, keep: str, published: Optional[str]) -> list[str]:
    """Discard every capture of this source id but `keep` and the published one (ids, sorted)."""
    if published == "?":
        return []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    ids = capture_ids(names)
    gone = sorted(cid for cid in ids - {keep, published} if discard_capture(folder, cid, published))
    for name in names:  # what a removal left when its holder died half-way
        if name.startswith(".trash-"):
            shutil.rmtree(folder / name, ignore_errors=True)
    return gone


def new_capture_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def node_part(nranks: int, nnodes: int, node_rank: int, ranks: Optional[Iterable[int]],
              capture_id: Optional[str]) -> tuple[list[int], str]:
    """This node's ranks of a capture (`ranks`, else an even contiguous split) and the capture id (a new one
    unless given), checked: UsageError names what does not fit. Both stores begin a capture with it."""
    from mxlaunch.coord.base import valid_id  # noqa: PLC0415 — store/ may use coord/, not the other way

    if nranks < 1 or nnodes < 1 or not 0 <= node_rank < nnodes or nranks % nnodes and ranks is None:
        raise UsageError(f"cannot split {nranks} ranks over {nnodes} nodes for node {node_rank}",
                         "pass the node's ranks explicitly")
    if ranks is None:
        per = nranks // nnodes
        ranks = range(node_rank * per, (node_rank + 1) * per)
    my_ranks = sorted(set(ranks))
    if not my_ranks or my_ranks[0] < 0 or my_ranks[-1] >= nranks:
        raise UsageError(f"node {node_rank}: ranks {my_ranks} are not within 0..{nranks - 1}", "check the plan")
    capture_id = capture_id or new_capture_id()
    if not valid_id(capture_id):
        raise UsageError(f"{capture_id!r} is not a valid capture id", "use letters, digits, '.', '_', '-'")
    return my_ranks, capture_id


def ranks_of_markers(markers: Iterable[Optional[object]], source_id: str, capture_id: str
                     ) -> Optional[tuple[set, dict[int, list[dict[str, Any]]]]]:
    """The nodes that marked their part of `capture_id` done and every rank's files, from their markers (None for
    one that could not be read). None: a marker unreadable or damaged — never publish from it. CheckFailed: two
    nodes wrote one rank. Both stores publish from it."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    nodes: set = set()
    for marker in markers:
        if marker is None:
            return None  # vanished (published meanwhile) or unreadable: not complete from here
        if not isinstance(marker, dict) or marker.get("capture_id") != capture_id:
            continue
        nodes.add(marker.get("node_rank"))
        try:
            for r in marker["ranks"]:
                if r["rank"] in ranks:
                    raise CheckFailed(f"capture {capture_id} of {source_id}: rank {r['rank']} was written by "
                                      "two nodes", "give each node its own ranks")
                ranks[r["rank"]] = r["files"]
        except (KeyError, TypeError):
            return None
    return nodes, ranks


def node_tmp(folder: Path, capture_id: str) -> Path:
    """A node's own temp folder of a capture (host, pid and a random part: never two writers in one)."""
    return folder / f".tmp-{capture_id}" / f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


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
