"""The artifact store on a shared filesystem: per-rank snapshots, manifests, atomic publish, checks.

Layout under the store root (`--artifact-path`, else $MXLAUNCH_ARTIFACT_PATH, else the user cache dir):

    <root>/<source_id>/manifest.json                         published last, by one atomic link/rename
    <root>/<source_id>/data-<capture_id>/ranks/<rank>/<file> the snapshot's files (safetensors or JSON)
    <root>/<source_id>/.tmp-<capture_id>/<host>-<pid>-<rand>/ranks/<rank>/  a node's capture in progress
    <root>/<source_id>/.nodes-<capture_id>/<node_rank>.json  a node's completion marker (its files, checksums)
    <root>/<source_id>/.nodes-<capture_id>/<node_rank>.failed.json  a node that will not deliver its part
    <root>/.claims/<source_id>.claim                          the capture claim (coord/file.py)
    <root>/kernel-cache/<key>/                                JIT kernel caches (kernelcache/archive.py)

A node writes its ranks into its temp folder, moves each finished rank folder into `data-<capture_id>/`
by rename, then writes its marker. A node that sees every rank covered builds the manifest and
publishes it with an exclusive link: one publisher wins, the others see EEXIST. (The launcher lets only
the claim holder publish, so that publishing and giving up on a capture are one process's decisions.)
Everything of an unpublished capture carries its id in its name: `discard_capture` removes it whole. Nothing is trusted
without checks: `lookup` validates the manifest (schema, ranks, paths inside the store, only safetensors
and JSON, sizes) and returns a one-line reason instead of raising; `verify(full=True)` adds checksums.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from mxlaunch import __version__
from mxlaunch.coord.base import ClaimInfo, Coordinator, valid_id
from mxlaunch.coord.file import FileCoordinator
from mxlaunch.fileutil import ensure_dir, last_used, read_json, write_json_atomic
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.safety.redact import redact
from mxlaunch.store.capture import (
    CaptureWriter, PendingCapture, _du, _user, discard_capture, node_markers, node_part, node_tmp, ranks_of_markers,
    reap_captures, write_failed)
from mxlaunch.store.snapshot import (  # noqa: F401 — the store's records and checks, importable from here
    ALLOWED_SUFFIXES, MANIFEST, SCHEMA, LookupResult, Snapshot, SnapshotFile, SnapshotMeta, StoreEntry, VerifyReport,
    _check_file, _utc_now, _validate_manifest, check_relpath, default_root, model_name, xxh3_file)



def build_manifest(source_id: str, capture_id: str, meta: SnapshotMeta, nranks: int, nnodes: int,
                   ranks: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """The manifest of a capture whose every rank is in (`ranks`: rank → its file records); the S3 store
    (store/s3_store.py) publishes the same document."""
    return {
        "schema": SCHEMA,
        "source_id": source_id,
        "capture_id": capture_id,
        "engine": meta.engine,
        "engine_version": meta.engine_version,
        "spec": redact(meta.spec),  # the store is read by others: the command's secrets never go in (redact.py)
        "identity": redact(meta.identity),
        "snapshot": {"format": meta.snapshot_format, "version": meta.snapshot_version},
        "nranks": nranks,
        "nnodes": nnodes,
        "ranks": [{"rank": r, "files": ranks[r]} for r in range(nranks)],
        "total_bytes": sum(f["bytes"] for files in ranks.values() for f in files),
        "created_at": _utc_now(),
        "created_by": {"user": _user(), "host": socket.gethostname(), "mxlaunch": __version__},
    }


def manifest_from_markers(markers: Iterable[Optional[object]], source_id: str, capture_id: str, meta: SnapshotMeta,
                          nranks: int, nnodes: int) -> Optional[dict[str, Any]]:
    """The manifest to publish once every node's marker (None: one unreadable) covers every rank; None while the
    capture is not complete or a marker is damaged. CheckFailed when it could never be published. Both stores
    publish what this returns (each its own way)."""
    gathered = ranks_of_markers(markers, source_id, capture_id)
    if gathered is None:
        return None
    nodes, ranks = gathered
    if len(nodes) < nnodes or set(ranks) != set(range(nranks)):
        return None
    manifest = build_manifest(source_id, capture_id, meta, nranks, nnodes, ranks)
    why = _validate_manifest(manifest, source_id)
    if why:
        raise CheckFailed(f"capture {capture_id} of {source_id} cannot be published: {why}", "capture it again")
    return manifest


# ---- the store ---------------------------------------------------------------------------------------------


# folders at the store's root that hold no snapshot: JIT kernel caches (kernelcache/archive.py), zygote images
# (warmstart/zygote_image.py) and lean engine snapshots (warmstart/lean_snapshot.py)
ENGINE_SNAPSHOTS = "engine-snapshots"
NOT_SNAPSHOTS = ("kernel-cache", "zygote-images", ENGINE_SNAPSHOTS)


class Store:
    """One artifact store root. Readers never raise on a bad snapshot: they refuse it with a reason.

    `store/opener.py` `open_store` gives an `S3Store` (store/s3_store.py) for `s3://bucket/prefix` instead:
    the same interface on a bucket, so that every command taking --artifact-path takes an S3 URL."""

    def __init__(self, root: str | os.PathLike[str] | None = None, coordinator: Optional[Coordinator] = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"artifact path {self.root} is not a folder", "pass a folder with --artifact-path")
        self.coordinator: Coordinator = coordinator if coordinator is not None else FileCoordinator(self.root)

    def folder(self, source_id: str) -> Path:
        if not valid_id(source_id):
            raise UsageError(f"{source_id!r} is not a valid source id", "use an id that `mxlaunch store list` shows")
        return self.root / source_id

    def exists(self, source_id: str) -> bool:
        """Is there anything of `source_id` in the store (a snapshot, or an unpublished capture's parts)?"""
        return self.folder(source_id).is_dir()

    def capture_spool(self, run_id: str) -> Optional[Path]:
        """A node-local folder a capture is written into before it is uploaded, when /dev/shm has no room;
        None: the capture is written straight into the store (an S3 store returns a local folder)."""
        return None

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

    def _file_checker(self, source_id: str, snap: Snapshot) -> Callable[[str, int], Optional[str]]:
        """A function (path in the manifest, bytes) → what is wrong with that file, or None. The S3 store
        lists the objects once and checks against that."""
        folder_real = Path(os.path.realpath(self.root)) / source_id
        return lambda rel, size: _check_file(folder_real, snap.folder, rel, size)

    def _file_xxh3(self, source_id: str, snap: Snapshot, rel: str) -> str:
        """A file's xxh3_128 read back from where the store keeps it (OSError when it cannot be read)."""
        return xxh3_file(snap.folder / rel)

    def _lookup(self, source_id: str) -> LookupResult:
        snap, why = self._load(source_id)
        if snap is None:
            return LookupResult(None, why)
        problem_of = self._file_checker(source_id, snap)
        for entry in snap.manifest["ranks"]:
            for f in entry["files"]:
                problem = problem_of(f["path"], f["bytes"])
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
        problem_of = self._file_checker(source_id, snap)
        to_hash: list[tuple[str, str]] = []
        for entry in snap.manifest["ranks"]:
            for f in entry["files"]:
                report.files += 1
                report.bytes += f["bytes"]
                problem = problem_of(f["path"], f["bytes"])
                if problem:
                    report.problems.append(f"rank {entry['rank']}: {problem}")
                elif full:
                    to_hash.append((f["path"], f["xxh3_128"]))
        if to_hash:
            def check(item: tuple[str, str]) -> Optional[str]:
                rel, want = item
                try:
                    got = self._file_xxh3(source_id, snap, rel)
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
            if child.name.startswith(".") or child.name in NOT_SNAPSHOTS or not valid_id(child.name) \
                    or child.is_symlink() or not child.is_dir():
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
            entries.append(StoreEntry(sid, status, why, size, manifest, holder, last_used(child, MANIFEST)))
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
        my_ranks, capture_id = node_part(nranks, nnodes, node_rank, ranks, capture_id)
        if (folder / MANIFEST).exists():
            raise CheckFailed(f"snapshot {source_id} is already published", "look it up instead of capturing")
        ensure_dir(folder)
        tmp = node_tmp(folder, capture_id)
        writer = CaptureWriter(self, source_id, meta, nranks, nnodes, node_rank, my_ranks, capture_id, tmp)
        for rank in my_ranks:
            writer.rank_dir(rank)  # the plugin writes <capture_dir>/<rank>/*.safetensors straight away
        return writer

    def try_publish(self, source_id: str, capture_id: str, meta: SnapshotMeta, nranks: int, nnodes: int) -> bool:
        """Publish the manifest if every node marker of this capture is in; True only for the one winner."""
        folder = self.folder(source_id)
        markers_dir = folder / f".nodes-{capture_id}"
        names, failed = node_markers(markers_dir)
        if names is None or failed:
            return False  # no markers yet, or a node said it will not deliver its part

        def read(name: str) -> Optional[object]:
            try:
                return read_json(markers_dir / name)
            except (OSError, ValueError):
                return None

        manifest = manifest_from_markers((read(n) for n in names), source_id, capture_id, meta, nranks, nnodes)
        if manifest is None:
            return False
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

    # ---- a capture spread over nodes ----

    def pending(self, source_id: str, capture_id: str) -> PendingCapture:
        """What the nodes of an unpublished capture reported: done nodes, and nodes that gave up (why)."""
        return PendingCapture.read(self.folder(source_id) / f".nodes-{capture_id}")

    def mark_node_failed(self, source_id: str, capture_id: str, node_rank: int, reason: str) -> None:
        """Say that node `node_rank` will not deliver its part of `capture_id` (the publisher gives up at once)."""
        write_failed(self.folder(source_id), capture_id, node_rank, reason)

    def discard_capture(self, source_id: str, capture_id: str) -> bool:
        """Remove everything of an unpublished capture (markers first, then data and temp folders); never the
        published snapshot's files. True when something was removed."""
        return discard_capture(self.folder(source_id), capture_id, self._published_capture(source_id))

    def reap_captures(self, source_id: str, keep: str) -> list[str]:
        """Discard every unpublished capture of `source_id` but `keep` (call it holding the claim: the
        others' claims are over, so nothing can publish them any more). Returns their ids."""
        return reap_captures(self.folder(source_id), keep, self._published_capture(source_id))

    def _published_capture(self, source_id: str) -> Optional[str]:
        try:
            data = read_json(self.folder(source_id) / MANIFEST)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return "?"  # unreadable: keep every data folder (it may be the snapshot's)
        cid = data.get("capture_id") if isinstance(data, dict) else None
        return cid if isinstance(cid, str) else "?"

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
