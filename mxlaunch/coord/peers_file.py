"""The P2P source registry on the shared filesystem (the default): one folder per source id and rank.

    <root>/.peers/<source_id>/<rank>/<worker>.json   the SourceRecord, written once (temp + link)
    <root>/.peers/<source_id>/<rank>/<worker>.beat   {"at", "ttl_s", "run_id"}, rewritten (temp + rename)
    <root>/.peers/<source_id>/<rank>/<worker>.verify    a `peers --verify` request {"nonce", "at"}
    <root>/.peers/<source_id>/<rank>/<worker>.verified  the source's answer {"nonce", "ok", "bad", ...}

No locks: a record appears by one `link()` (a second publisher under the same worker id loses unless the
first one is stale), a heartbeat replaces a tiny file by rename, and a reader validates whatever it finds
(size caps, schema, the record must match the path it was found under). Works between hosts on NFS or
Lustre.

Records hold what lets a peer reach a worker's memory (NIXL metadata, addresses), so the registry's files
are private from their creation: 0600 in 0700 folders, or 0640 in 2770 folders with the shared group
(`MXLAUNCH_GROUP`; fileutil.private_mode). A reader refuses a record others could have written or read
(fileutil.exposure) and says why in `refusals` — a target must not trust memory someone else described.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

from mxlaunch.coord.base import valid_id
from mxlaunch.coord.peers_record import (
    DEFAULT_TTL_S, MAX_BEAT_BYTES, MAX_RECORD_BYTES, STALE, Beat, BasePublication, PeerEntry, SourceRecord,
    check_record, check_ttl, judge, ordered, reapable)
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.fileutil import Exposed, boot_id, ensure_private_dir, exposure, read_json, write_json_atomic

PEERS_DIR = ".peers"
_RANK_RE = re.compile(r"^(0|[1-9][0-9]{0,8})$")
_TEMP_AGE_S = 60.0  # a writer's temp file older than this (+ grace) is left over from a crash


class FilePublication(BasePublication):
    """A record this process published under `<root>/.peers/`."""

    def __init__(self, registry: "FileRegistry", record: SourceRecord, ttl_s: float) -> None:
        super().__init__(record, ttl_s)
        self._reg = registry
        self.path = registry.record_path(record.source_id, record.rank, record.worker)
        self.beat_path = self.path.with_suffix(".beat")
        self._identity = _identity(self.path)  # a later record under the same worker id is another file

    def _beat(self) -> bool:
        if _identity(self.path) != self._identity:
            return False  # removed (or replaced by a later publisher of the same worker id)
        try:
            write_json_atomic(self.beat_path, Beat(time.time(), self.ttl_s, self.record.run_id).to_json(), private=True)
        except FileNotFoundError:
            return False  # the folder was reaped: the record is gone
        return True

    def _pending_verify(self) -> Optional[str]:
        path = self.path.with_suffix(".verify")
        try:
            data = read_json(path, limit=MAX_BEAT_BYTES, private=True)
        except (OSError, ValueError):
            return None
        path.unlink(missing_ok=True)
        nonce = data.get("nonce") if isinstance(data, dict) else None
        return nonce if isinstance(nonce, str) and valid_id(nonce) else None

    def _answer_verify(self, nonce: str, result: dict) -> None:
        write_json_atomic(self.path.with_suffix(".verified"), {**result, "nonce": nonce}, private=True)

    def _drop(self) -> None:
        stored = self._reg._read_record(self.path)
        if isinstance(stored, SourceRecord) and stored.same_publisher(self.record):
            self._reg._unlink_pair(self.path)


class FileRegistry:
    """Source records under `<root>/.peers/`. `host` is overridable for tests (another host: no pid check)."""

    def __init__(self, root: str | os.PathLike[str], *, host: str | None = None) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"registry folder {self.root} is not a folder", "pass a folder (the artifact store)")
        self.dir = self.root / PEERS_DIR
        self.url = f"file:{self.root}"
        self.host = host or socket.gethostname()
        self._boot_id = boot_id()
        self._refused: dict[str, str] = {}  # path → why the last read refused it (others could have written it)

    @property
    def refusals(self) -> list[str]:
        """One line per record or folder the last reads refused because others could have written it."""
        return [f"{path} {why} — refused (a record must be private: `chmod 600` it or let its owner republish)"
                for path, why in sorted(self._refused.items())]

    # ---- paths ----

    def rank_dir(self, source_id: str, rank: int) -> Path:
        if not valid_id(source_id):
            raise UsageError(f"{source_id!r} is not a valid source id", "use the id `mxlaunch store list` shows")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0 or not _RANK_RE.match(str(rank)):
            raise UsageError(f"rank {rank!r} is not a rank", "pass a whole number ≥ 0")
        return self.dir / source_id / str(rank)

    def record_path(self, source_id: str, rank: int, worker: str) -> Path:
        if not valid_id(worker):
            raise UsageError(f"worker id {worker!r} is not one safe path component", "use letters, digits, . _ -")
        return self.rank_dir(source_id, rank) / f"{worker}.json"

    # ---- writing ----

    def publish(self, record: SourceRecord, ttl_s: float = DEFAULT_TTL_S) -> FilePublication:
        """Write the record once, then its first heartbeat; a live record under the same worker id refuses."""
        check_ttl(ttl_s)
        check_record(record)
        path = self.record_path(record.source_id, record.rank, record.worker)
        for _ in range(8):
            try:
                ensure_private_dir(path.parent, self.root)
                won = write_json_atomic(path, record.to_json(), exclusive=True, private=True)
            except FileNotFoundError:
                continue  # a reaper removed the empty folder meanwhile: make it again
            if won:
                publication = FilePublication(self, record, ttl_s)
                try:
                    publication.heartbeat()
                except BaseException:
                    self._unlink_pair(path)
                    raise
                return publication
            now = time.time()
            entry = self._entry(path, now)
            if isinstance(entry, PeerEntry):
                alive = entry.state != STALE
            else:  # unreadable (maybe a newer schema): its heartbeat decides
                beat = self._read_beat(path.with_suffix(".beat"))
                alive = beat is not None and now - beat.at <= beat.ttl_s
            if alive:
                who = f" (pid {entry.record.pid} on {entry.record.host})" if isinstance(entry, PeerEntry) else ""
                raise CheckFailed(f"worker {record.worker} already publishes {record.source_id} rank {record.rank}{who}",
                                  "give each worker a unique id, or unpublish the old record first")
            self._unlink_pair(path)  # a stale record under our worker id: replace it
        raise CheckFailed(f"could not publish {path}: it keeps changing under us", "retry the publish")

    def remove(self, source_id: str, rank: int, worker: str) -> bool:
        return self._unlink_pair(self.record_path(source_id, rank, worker))

    def request_verify(self, source_id: str, rank: int, worker: str) -> str:
        """Ask a live source to recompute its checksums (answered at its next heartbeat); returns the nonce."""
        nonce = secrets.token_hex(8)
        path = self.record_path(source_id, rank, worker)
        path.with_suffix(".verified").unlink(missing_ok=True)
        write_json_atomic(path.with_suffix(".verify"), {"nonce": nonce, "at": time.time()}, private=True)
        return nonce

    def verify_answer(self, source_id: str, rank: int, worker: str, nonce: str) -> Optional[dict]:
        """The source's answer to request `nonce`, or None while there is none."""
        try:
            data = read_json(self.record_path(source_id, rank, worker).with_suffix(".verified"), limit=1 << 16,
                             private=True)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("nonce") == nonce else None

    def remove_run(self, run_id: str) -> int:
        """Drop every record `run_id` published (reads the tiny heartbeats first, records only to confirm)."""
        removed = 0
        for path in self._record_paths():
            beat = self._read_beat(path.with_suffix(".beat"))
            if beat is not None and beat.run_id and beat.run_id != run_id:
                continue
            record = self._read_record(path)
            if isinstance(record, SourceRecord) and record.run_id == run_id and self._unlink_pair(path):
                removed += 1
        return removed

    def reap(self, grace_s: float = 60.0) -> int:
        """Remove records stale for longer than grace_s (and unreadable ones whose heartbeat ended as long ago),
        orphan heartbeats, writers' leftover temp files, and empty folders. Returns the records removed."""
        now, removed = time.time(), 0
        for path in self._record_paths():
            entry = self._entry(path, now)
            if isinstance(entry, PeerEntry):
                gone = reapable(entry, grace_s, now)
            else:  # unreadable (corrupt, or a newer schema): only its heartbeat says whether it is alive
                beat = self._read_beat(path.with_suffix(".beat"))
                since = beat.at + beat.ttl_s if beat is not None else _mtime(path)
                gone = since is not None and now - since > grace_s
            if gone and self._unlink_pair(path):
                removed += 1
        for folder in self._rank_dirs():
            self._sweep(folder, now, grace_s)
        return removed

    # ---- reading ----

    def sources(self, source_id: str, rank: int | None = None, *, include_stale: bool = False) -> list[PeerEntry]:
        self._refused.clear()
        if rank is not None:
            folders = [self.rank_dir(source_id, rank)]
        else:
            folders = list(self._rank_dirs(self.rank_dir(source_id, 0).parent))
        now = time.time()
        return ordered([e for f in folders for e in self._scan(f, now, include_stale)])

    def all_sources(self, *, include_stale: bool = True) -> list[PeerEntry]:
        self._refused.clear()
        now = time.time()
        return ordered([e for f in self._rank_dirs() for e in self._scan(f, now, include_stale)])

    # ---- internals ----

    def _scan(self, folder: Path, now: float, include_stale: bool) -> Iterator[PeerEntry]:
        if folder.is_symlink() or folder.parent.is_symlink():
            return  # records live in real folders of the registry, never somewhere a link points
        for d in (self.dir, folder.parent, folder):  # a folder others can write: any record in it may be theirs
            try:
                why = exposure(os.lstat(d), is_dir=True)
            except OSError:
                return
            if why:
                self._refused[str(d)] = why
                return
        for path in self._records_in(folder):
            if not include_stale:  # skip reading (maybe large) records whose heartbeat already ran out
                beat = self._read_beat(path.with_suffix(".beat"))
                if beat is None or now - beat.at > beat.ttl_s:
                    continue
            entry = self._entry(path, now)
            if isinstance(entry, PeerEntry) and (include_stale or entry.state != STALE):
                yield entry

    def _entry(self, path: Path, now: float) -> PeerEntry | str | None:
        """The record at `path` with its state; None when absent, "unreadable" when not a valid record."""
        record = self._read_record(path)
        if not isinstance(record, SourceRecord):
            return record
        return judge(record, self._read_beat(path.with_suffix(".beat")), host=self.host, boot=self._boot_id, now=now)

    def _read_record(self, path: Path) -> SourceRecord | str | None:
        try:
            data = read_json(path, limit=MAX_RECORD_BYTES, private=True)
        except FileNotFoundError:
            return None
        except Exposed as exc:
            self._refused[str(path)] = str(exc)
            return "unreadable"
        except (OSError, ValueError):
            return "unreadable"
        record = SourceRecord.from_json(data)
        rank_dir = path.parent
        if record is None or (record.source_id, str(record.rank), record.worker) != \
                (rank_dir.parent.name, rank_dir.name, path.stem):
            return "unreadable"  # a record must be found where its own fields say it lives
        return record

    @staticmethod
    def _read_beat(path: Path) -> Optional[Beat]:
        try:
            return Beat.from_json(read_json(path, limit=MAX_BEAT_BYTES))
        except (OSError, ValueError):
            return None

    def _rank_dirs(self, under: Path | None = None) -> Iterator[Path]:
        """`<source_id>/<rank>` folders (real folders with valid names only) under `.peers` or one source id."""
        sid_dirs = [under] if under is not None else [d for d in _children(self.dir) if valid_id(d.name)]
        for sid_dir in sid_dirs:
            if sid_dir.is_symlink():
                continue
            for rank_dir in _children(sid_dir):
                if _RANK_RE.match(rank_dir.name) and not rank_dir.is_symlink() and rank_dir.is_dir():
                    yield rank_dir

    @staticmethod
    def _records_in(folder: Path) -> list[Path]:
        return sorted(p for p in _children(folder) if p.suffix == ".json" and valid_id(p.stem))

    def _record_paths(self) -> Iterator[Path]:
        for folder in self._rank_dirs():
            yield from self._records_in(folder)

    @staticmethod
    def _unlink_pair(path: Path) -> bool:
        """Remove a record and its heartbeat; True when the record was there."""
        try:
            path.unlink()
            existed = True
        except FileNotFoundError:
            existed = False
        path.with_suffix(".beat").unlink(missing_ok=True)
        path.with_suffix(".verify").unlink(missing_ok=True)  # the answer (.verified) stays for its asker; reaped
        return existed

    def _sweep(self, folder: Path, now: float, grace_s: float) -> None:
        """Orphan heartbeats and leftover temp files in a rank folder; then the folder (and its parent) if empty."""
        for p in _children(folder):
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                old = now - (_mtime(p) or now) > _TEMP_AGE_S + grace_s
            elif p.suffix in (".verify", ".verified") and not p.with_suffix(".json").exists():
                old = now - (_mtime(p) or now) > grace_s
            elif p.suffix == ".beat" and not p.with_suffix(".json").exists():
                beat = self._read_beat(p)
                since = beat.at + beat.ttl_s if beat is not None else _mtime(p)
                old = since is not None and now - since > grace_s
            else:
                continue
            if old:
                p.unlink(missing_ok=True)
        for empty in (folder, folder.parent):
            try:
                empty.rmdir()  # fails while anything is inside; a publisher racing this retries
            except OSError:
                break


def _children(folder: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(folder)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _identity(path: Path) -> Optional[tuple[int, int, int, int]]:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _mtime(path: Path) -> Optional[float]:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return None
