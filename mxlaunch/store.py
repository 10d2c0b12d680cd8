"""The artifact store on a shared filesystem: per-rank snapshots, manifests, atomic publish, checks.

Layout under the store root (`--artifact-path`, else $MXLAUNCH_ARTIFACT_PATH, else the user cache dir):

    <root>/<source_id>/manifest.json                         published last, by one atomic link/rename
    <root>/<source_id>/data-<capture_id>/ranks/<rank>/<file> the snapshot's files (safetensors or JSON)
    <root>/<source_id>/.tmp-<host>-<pid>-<rand>/ranks/<rank>/ a node's capture in progress
    <root>/<source_id>/.nodes-<capture_id>/<node_rank>.json  a node's completion marker (its files, checksums)
    <root>/.claims/<source_id>.claim                          the capture claim (coord/file.py)

A node writes its ranks into its temp folder, moves each finished rank folder into `data-<capture_id>/`
by rename, then writes its marker. Whichever node sees every rank covered builds the manifest and
publishes it with an exclusive link: one publisher wins, the others see EEXIST. Nothing is trusted
without checks: `lookup` validates the manifest (schema, ranks, paths inside the store, only safetensors
and JSON, sizes) and returns a one-line reason instead of raising; `verify(full=True)` adds checksums.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import os
import re
import secrets
import shutil
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, NamedTuple, Optional

import xxhash

from mxlaunch import __version__
from mxlaunch.coord.base import ClaimInfo, Coordinator, valid_id
from mxlaunch import settings
from mxlaunch.contract import RAW as SNAPSHOT_FORMAT
from mxlaunch.contract import SNAPSHOT_VERSION
from mxlaunch.coord.file import FileCoordinator
from mxlaunch.fileutil import ensure_dir, read_json, secure, write_json_atomic
from mxlaunch.errors import CheckFailed, UsageError

SCHEMA = 1
MANIFEST = "manifest.json"
# trust rule: nothing else is ever read from the store (".safetensor": SGLang's presharded dump names its files so)
ALLOWED_SUFFIXES = (".safetensors", ".safetensor", ".json")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 8 << 20


def default_root() -> Path:
    """$MXLAUNCH_ARTIFACT_PATH, else $XDG_CACHE_HOME/mxlaunch/store, else ~/.cache/mxlaunch/store."""
    env = settings.artifact_path()
    if env is not None:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "mxlaunch" / "store"


def xxh3_file(path: str | os.PathLike[str]) -> str:
    """xxh3_128 hex digest of a file, streamed."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def check_relpath(rel: object) -> Optional[str]:
    """Why a manifest path may not be used (None when fine): relative, no '..', safetensors or JSON only."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        return f"path {rel!r} is not a plain relative path"
    p = PurePosixPath(rel)
    if p.is_absolute():
        return f"path {rel!r} is absolute"
    if any(part in ("..", ".", "") for part in rel.split("/")):
        return f"path {rel!r} leaves the snapshot folder"
    if not p.name.endswith(ALLOWED_SUFFIXES) or p.name.startswith("."):
        return f"path {rel!r} is not a .safetensors or .json file (only those are ever read)"
    return None


# ---- what a snapshot is ------------------------------------------------------------------------------------


class SnapshotFile(NamedTuple):
    path: Path
    bytes: int
    xxh3_128: str


@dataclass(frozen=True)
class SnapshotMeta:
    """What the launcher knows about the snapshot it captures (goes into the manifest as given)."""

    engine: str
    engine_version: Optional[str] = None
    spec: dict[str, Any] = field(default_factory=dict)  # the LaunchSpec as a dict (model, tp, pp, ...)
    identity: dict[str, Any] = field(default_factory=dict)  # the fields the source id was computed from
    snapshot_format: str = SNAPSHOT_FORMAT
    snapshot_version: int = SNAPSHOT_VERSION


@dataclass(frozen=True)
class Snapshot:
    """A published snapshot that passed the checks of `Store.lookup`."""

    source_id: str
    folder: Path  # <root>/<source_id>
    manifest: dict[str, Any]

    @property
    def nranks(self) -> int:
        return int(self.manifest["nranks"])

    @property
    def total_bytes(self) -> int:
        return sum(f["bytes"] for r in self.manifest["ranks"] for f in r["files"])

    def files_for_ranks(self, ranks: Iterable[int]) -> list[SnapshotFile]:
        """Absolute paths, sizes and checksums of the given ranks' files, in manifest order."""
        by_rank = {r["rank"]: r["files"] for r in self.manifest["ranks"]}
        out: list[SnapshotFile] = []
        for rank in ranks:
            if rank not in by_rank:
                raise UsageError(f"snapshot {self.source_id} has no rank {rank} (it has {self.nranks})",
                                 "plan the ranks of this snapshot's world size")
            out.extend(SnapshotFile(self.folder / f["path"], f["bytes"], f["xxh3_128"]) for f in by_rank[rank])
        return out


class LookupResult(NamedTuple):
    snapshot: Optional[Snapshot]
    reason: str  # "" when found; else one line saying why the snapshot is refused


@dataclass
class VerifyReport:
    source_id: str
    ok: bool
    files: int = 0
    bytes: int = 0
    full: bool = True
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source_id": self.source_id, "ok": self.ok, "full": self.full, "files": self.files,
                "bytes": self.bytes, "problems": list(self.problems)}


@dataclass
class StoreEntry:
    source_id: str
    status: str  # ok | incomplete | claimed | refused
    reason: str
    bytes: int
    manifest: Optional[dict[str, Any]] = None
    holder: Optional[ClaimInfo] = None

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest or {}
        spec = m.get("spec") if isinstance(m.get("spec"), dict) else {}
        return {
            "source_id": self.source_id, "status": self.status, "reason": self.reason or None,
            "model": spec.get("model"), "model_name": model_name(spec.get("model")), "engine": m.get("engine"), "engine_version": m.get("engine_version"),
            "tp": spec.get("tp"), "pp": spec.get("pp"), "nranks": m.get("nranks"), "bytes": self.bytes,
            "created_at": m.get("created_at"),
            "claimed_by": None if self.holder is None else {
                "host": self.holder.host, "pid": self.holder.pid, "expires_at": self.holder.expires_at},
        }


def model_name(model: Optional[str]) -> Optional[str]:
    """A model as people name it: a hub id as given; a hub-cache snapshot folder as its org/name; any other
    folder by its last component (the full path stays in the JSON)."""
    if not model:
        return None
    m = re.search(r"models--([^/]+)/snapshots/", model)
    if m:
        return m.group(1).replace("--", "/")
    if model.startswith(("/", ".", "~")):
        return Path(model.rstrip("/")).name or model
    return model


# ---- manifest validation ---------------------------------------------------------------------------------


def _validate_manifest(data: object, source_id: str) -> Optional[str]:
    """None when the manifest has the right shape; else why not (one line)."""
    if not isinstance(data, dict):
        return "manifest.json is not a JSON object"
    if data.get("schema") != SCHEMA:
        return f"manifest.json has schema {data.get('schema')!r}, this mxlaunch reads schema {SCHEMA}"
    if data.get("source_id") != source_id:
        return f"manifest.json is for source id {data.get('source_id')!r}, not {source_id}"
    nranks = data.get("nranks")
    if not isinstance(nranks, int) or isinstance(nranks, bool) or nranks < 1:
        return "manifest.json has no valid nranks"
    ranks = data.get("ranks")
    if not isinstance(ranks, list):
        return "manifest.json has no ranks list"
    seen: set[int] = set()
    for entry in ranks:
        if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int) or not isinstance(entry.get("files"), list):
            return "manifest.json has a malformed rank entry"
        rank = entry["rank"]
        if not 0 <= rank < nranks or rank in seen:
            return f"manifest.json lists rank {rank} out of range or twice (nranks {nranks})"
        seen.add(rank)
        if not entry["files"]:
            return f"manifest.json lists no files for rank {rank}"
        for f in entry["files"]:
            if not isinstance(f, dict):
                return f"manifest.json has a malformed file entry for rank {rank}"
            why = check_relpath(f.get("path"))
            if why:
                return f"rank {rank}: {why}"
            size, digest = f.get("bytes"), f.get("xxh3_128")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                return f"rank {rank}: {f['path']} has no valid byte count"
            if not isinstance(digest, str) or not _HEX32.match(digest):
                return f"rank {rank}: {f['path']} has no valid xxh3_128"
    missing = sorted(set(range(nranks)) - seen)
    if missing:
        return f"rank {missing[0]} is missing from the manifest ({len(missing)} of {nranks} ranks missing)"
    return None


def _check_file(folder_real: Path, folder: Path, rel: str, size: int) -> Optional[str]:
    """Quick check of one listed file: inside the snapshot folder (symlinks resolved), regular, right size."""
    path = folder / rel
    try:
        real = Path(os.path.realpath(path))
    except OSError as exc:
        return f"{rel}: {exc.strerror}"
    if real != folder_real and folder_real not in real.parents:
        return f"{rel} resolves outside the store ({real})"
    if not real.name.endswith(ALLOWED_SUFFIXES):
        return f"{rel} resolves to {real.name}, not a .safetensors or .json file"
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return f"{rel} is missing"
    except OSError as exc:
        return f"{rel}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{rel} is not a regular file"
    if st.st_size != size:
        return f"{rel} is {st.st_size} bytes, the manifest says {size}"
    return None


# ---- the store ---------------------------------------------------------------------------------------------


class Store:
    """One artifact store root. Readers never raise on a bad snapshot: they refuse it with a reason."""

    def __init__(self, root: str | os.PathLike[str] | None = None, coordinator: Optional[Coordinator] = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"artifact path {self.root} is not a folder", "pass a folder with --artifact-path")
        self.coordinator: Coordinator = coordinator if coordinator is not None else FileCoordinator(self.root)

    def folder(self, source_id: str) -> Path:
        if not valid_id(source_id):
            raise UsageError(f"{source_id!r} is not a valid source id", "use an id that `mxlaunch store list` shows")
        return self.root / source_id

    # ---- reading ----

    def lookup(self, source_id: str) -> LookupResult:
        """The snapshot if it is published and passes the quick checks (manifest, ranks, paths, sizes)."""
        try:
            return self._lookup(source_id)
        except Exception as exc:  # never raise into the launcher: an unexpected defect is a refusal too
            return LookupResult(None, f"snapshot {source_id}: cannot be read ({type(exc).__name__}: {exc})")

    def _load(self, source_id: str) -> tuple[Optional[Snapshot], str]:
        if not valid_id(source_id):
            return None, f"{source_id!r} is not a valid source id"
        folder = self.root / source_id
        if not folder.is_dir():
            return None, f"no snapshot for {source_id} in {self.root}"
        try:
            data = read_json(folder / MANIFEST)
        except FileNotFoundError:
            return None, f"snapshot {source_id} has no manifest (its capture never finished)"
        except UnicodeDecodeError:
            return None, f"snapshot {source_id}: manifest.json is not UTF-8 JSON"
        except ValueError as exc:
            return None, f"snapshot {source_id}: manifest.json is not valid JSON ({str(exc).splitlines()[0]})"
        except OSError as exc:
            return None, f"snapshot {source_id}: cannot read manifest.json ({exc.strerror or exc})"
        why = _validate_manifest(data, source_id)
        if why:
            return None, f"snapshot {source_id}: {why}"
        return Snapshot(source_id, folder, data), ""

    def _lookup(self, source_id: str) -> LookupResult:
        snap, why = self._load(source_id)
        if snap is None:
            return LookupResult(None, why)
        folder_real = Path(os.path.realpath(self.root)) / source_id
        for entry in snap.manifest["ranks"]:
            for f in entry["files"]:
                problem = _check_file(folder_real, snap.folder, f["path"], f["bytes"])
                if problem:
                    return LookupResult(None, f"snapshot {source_id}: rank {entry['rank']}: {problem}")
        return LookupResult(snap, "")

    def verify(self, source_id: str, full: bool = True, threads: int = 8) -> VerifyReport:
        """Every check of `lookup`, for every file (not just the first problem); `full` adds xxh3_128 checksums."""
        report = VerifyReport(source_id, ok=False, full=full)
        snap, why = self._load(source_id)
        if snap is None:
            report.problems.append(why)
            return report
        folder_real = Path(os.path.realpath(self.root)) / source_id
        to_hash: list[tuple[str, str]] = []
        for entry in snap.manifest["ranks"]:
            for f in entry["files"]:
                report.files += 1
                report.bytes += f["bytes"]
                problem = _check_file(folder_real, snap.folder, f["path"], f["bytes"])
                if problem:
                    report.problems.append(f"rank {entry['rank']}: {problem}")
                elif full:
                    to_hash.append((f["path"], f["xxh3_128"]))
        if to_hash:
            def check(item: tuple[str, str]) -> Optional[str]:
                rel, want = item
                try:
                    got = xxh3_file(snap.folder / rel)
                except OSError as exc:
                    return f"{rel}: {exc.strerror or exc}"
                return None if got == want else f"{rel}: checksum {got} does not match the manifest's {want}"

            with ThreadPoolExecutor(max_workers=max(1, min(threads, len(to_hash)))) as pool:
                report.problems.extend(p for p in pool.map(check, to_hash) if p)
        report.ok = not report.problems
        return report

    def list(self) -> list[StoreEntry]:
        """Every snapshot folder under the root with its status (ok / claimed / incomplete / refused)."""
        if not self.root.is_dir():
            return []
        entries = []
        for child in sorted(self.root.iterdir()):
            if child.name.startswith(".") or not valid_id(child.name) or child.is_symlink() or not child.is_dir():
                continue
            sid = child.name
            found, why = self.lookup(sid)
            holder = self._holder(sid)
            manifest = found.manifest if found else None
            if found:
                status, size = "ok", found.total_bytes
            else:
                snap, _ = self._load(sid)
                manifest = snap.manifest if snap else None
                status = "claimed" if holder else ("refused" if (child / MANIFEST).exists() else "incomplete")
                size = _du(child)
            entries.append(StoreEntry(sid, status, why, size, manifest, holder))
        return entries

    def _holder(self, source_id: str) -> Optional[ClaimInfo]:
        try:
            return self.coordinator.holder(source_id)
        except Exception:
            return None

    # ---- writing ----

    def begin_capture(
        self,
        source_id: str,
        meta: SnapshotMeta,
        *,
        nranks: int,
        nnodes: int = 1,
        node_rank: int = 0,
        ranks: Optional[Iterable[int]] = None,
        capture_id: Optional[str] = None,
    ) -> "CaptureWriter":
        """Start this node's part of a capture. All nodes of one capture must pass the same `capture_id`
        (e.g. the claim holder's `extra["capture_id"]`); `ranks` defaults to an even contiguous split."""
        folder = self.folder(source_id)
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
        if (folder / MANIFEST).exists():
            raise CheckFailed(f"snapshot {source_id} is already published", "look it up instead of capturing")
        ensure_dir(folder)
        tmp = folder / f".tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        writer = CaptureWriter(self, source_id, meta, nranks, nnodes, node_rank, my_ranks, capture_id, tmp)
        for rank in my_ranks:
            writer.rank_dir(rank)  # the plugin writes <capture_dir>/<rank>/*.safetensors straight away
        return writer

    def try_publish(self, source_id: str, capture_id: str, meta: SnapshotMeta, nranks: int, nnodes: int) -> bool:
        """Publish the manifest if every node marker of this capture is in; True only for the one winner."""
        folder = self.folder(source_id)
        markers_dir = folder / f".nodes-{capture_id}"
        try:
            names = sorted(n for n in os.listdir(markers_dir) if n.endswith(".json") and not n.startswith("."))
        except FileNotFoundError:
            return False
        ranks: dict[int, list[dict[str, Any]]] = {}
        nodes = set()
        for name in names:
            try:
                marker = read_json(markers_dir / name)
            except (OSError, ValueError):
                return False  # vanished (published meanwhile) or unreadable: not complete from here
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
                return False  # a damaged marker: never publish from it
        if len(nodes) < nnodes or set(ranks) != set(range(nranks)):
            return False
        user = _user()
        manifest = {
            "schema": SCHEMA,
            "source_id": source_id,
            "capture_id": capture_id,
            "engine": meta.engine,
            "engine_version": meta.engine_version,
            "spec": meta.spec,
            "identity": meta.identity,
            "snapshot": {"format": meta.snapshot_format, "version": meta.snapshot_version},
            "nranks": nranks,
            "nnodes": nnodes,
            "ranks": [{"rank": r, "files": ranks[r]} for r in range(nranks)],
            "total_bytes": sum(f["bytes"] for files in ranks.values() for f in files),
            "created_at": _utc_now(),
            "created_by": {"user": user, "host": socket.gethostname(), "mxlaunch": __version__},
        }
        why = _validate_manifest(manifest, source_id)
        if why:
            raise CheckFailed(f"capture {capture_id} of {source_id} cannot be published: {why}", "capture it again")
        won = write_json_atomic(folder / MANIFEST, manifest, exclusive=True)
        if won:
            shutil.rmtree(markers_dir, ignore_errors=True)
        else:
            published, _ = self._load(source_id)
            if published is not None and published.manifest.get("capture_id") != capture_id:
                # another capture of the same source id won: this one's files are garbage
                shutil.rmtree(folder / f"data-{capture_id}", ignore_errors=True)
                shutil.rmtree(markers_dir, ignore_errors=True)
        return won

    def remove(self, source_id: str, force: bool = False) -> None:
        """Remove a snapshot folder: first renamed away (gone at once for readers), then deleted."""
        folder = self.folder(source_id)
        if not folder.is_dir() or folder.is_symlink():
            raise UsageError(f"no snapshot {source_id} in {self.root}", "see `mxlaunch store list`")
        holder = self._holder(source_id)
        if holder is not None and not force:
            raise CheckFailed(f"snapshot {source_id} is claimed by {holder.describe()}",
                              "wait for the capture to finish, or pass --force")
        trash = self.root / f".trash-{source_id}-{secrets.token_hex(4)}"
        try:
            os.rename(folder, trash)
        except FileNotFoundError as exc:
            raise UsageError(f"no snapshot {source_id} in {self.root}", "see `mxlaunch store list`") from exc
        shutil.rmtree(trash)


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
