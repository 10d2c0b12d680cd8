"""JIT kernel caches in the artifact store: one tar archive per key, checked before anything is written.

    <store>/kernel-cache/<key>/key.json              the key's fields + which archive is current (atomic rename)
    <store>/kernel-cache/<key>/cache-<id>.tar        the archive (written under .tmp-*, renamed when complete)
    <store>/.claims/kc-<key>/                        one writer per key (coord/file.py claims)

Restore never fails a launch: a missing, damaged, oversized or foreign archive is a miss with a one-line
reason. Every member is checked before the first byte is written (relative names only, no `..`, no links
or devices — regular files and folders only — and a size cap), and the stored fields must hash to the key
asked for: a cache is never restored under another key.

An archive is code (Triton's .so launchers, Inductor's .py modules and pickles), so it is restored only when
a trusted writer wrote it (mxlaunch/safety/trust.py: this user alone unless MXLAUNCH_TRUSTED_WRITERS names more):
the key's folder, key.json and the archive are each opened without following links and judged on their
descriptor (owner a trusted writer, nobody else can write the files), both files inside the one folder
descriptor, and the archive's sha256 — computed while it was written — must match the one key.json records
before a member is read. A group member who renames folders can at most put back another record that a
trusted writer made for the same key; an archive or record of anyone else's is refused (`refused` in the
event, with its reason), and the engine compiles as on a miss.

Building and checking the tar itself (members, sizes, links, extraction by rename) is kernelcache/tarball.py;
this module is the store's side: keys, records, trust, claims.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from mxlaunch import __version__
from mxlaunch.safety import trust
from mxlaunch.coord.base import Coordinator, valid_id
from mxlaunch.fileutil import ensure_dir, last_used, mark_used, read_json, secure, unique_name, write_json_temp
from mxlaunch.kernelcache.caches import cache_key
from mxlaunch.kernelcache.ninja_rebase import rebase_tree
from mxlaunch.kernelcache.tarball import ArchiveRefused, build_archive, extract
from mxlaunch.store.snapshot import _utc_now

KC_DIR = "kernel-cache"
KEY_JSON = "key.json"
SCHEMA = 1
CLAIM_TTL_S = 60.0
_ARCHIVE = re.compile(r"^cache-[A-Za-z0-9_-]{1,64}\.tar$")


class _Miss(Exception):
    """lookup's way out: the one-line reason, and whether a present archive or record was refused (untrusted,
    tampered) rather than absent or damaged."""

    def __init__(self, reason: str, refused: bool = False) -> None:
        super().__init__(reason)
        self.refused = refused


@dataclass
class RestoreResult:
    status: str  # "hit" (files restored) | "local" (every file already on this node) | "miss"
    reason: str = ""
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    kept: int = 0  # files of the archive already on this node (left as they were)
    rebased: int = 0  # ninja-built modules moved from the folder the archive was captured in (ninja_rebase.py)
    refused: bool = False  # an archive was there but not restored: untrusted writer, or not what its writer recorded


@dataclass
class CaptureResult:
    published: bool
    reason: str = ""
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CacheEntry:
    key: str
    meta: Dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    reason: str = ""
    last_used: Optional[float] = None  # epoch seconds: the last restore's stamp, else when it was written

    def to_dict(self) -> Dict[str, Any]:
        fields = self.meta.get("fields") or {}
        return {"key": self.key, "ok": self.ok, "reason": self.reason, "engine": fields.get("engine"),
                "engine_version": fields.get("engine_version"), "model": self.meta.get("model"),
                "bytes": self.meta.get("bytes"), "files": self.meta.get("files"),
                "created_at": self.meta.get("created_at"), "last_used": self.last_used, "fields": fields}


def _no_write_for_others(path: Path) -> None:
    """Code in the store is written by its owner alone: no write bit for group or others, whatever the umask or
    MXLAUNCH_GROUP (secure() gives the group read; a writable record or archive could be changed under its name)."""
    mode = os.lstat(path).st_mode & 0o7777
    os.chmod(path, mode & ~0o022)


# ---- the store's kernel-cache folder ------------------------------------------------------------------


class KernelCacheStore:
    def __init__(self, store_root: Path, coordinator: Coordinator, writers: Optional[trust.Writers] = None) -> None:
        self.root = Path(store_root) / KC_DIR
        self.coordinator = coordinator
        self.writers = writers if writers is not None else trust.writers()  # a bad MXLAUNCH_TRUSTED_WRITERS: exit 2

    def folder(self, key: str) -> Path:
        if not valid_id(key):
            raise ArchiveRefused(f"{key!r} is not a valid kernel cache key")
        return self.root / key

    def lookup(self, key: str) -> Tuple[Optional[Dict[str, Any]], str]:
        """(key.json, "") when the key has a usable archive a trusted writer wrote; (None, one-line reason)
        otherwise. Never raises."""
        try:
            meta, fd = self._open(key)
        except _Miss as miss:
            return None, str(miss)
        os.close(fd)
        return meta, ""

    def _open(self, key: str) -> Tuple[Dict[str, Any], int]:
        """key.json and a descriptor of its archive, each a trusted writer's (trust.py), both read inside one
        descriptor of the key's folder; raises _Miss with the reason."""
        try:
            folder = self.folder(key)
            dir_fd, why = trust.open_trusted(folder, self.writers, f"its folder {folder}", is_dir=True, shared_ok=True)
        except FileNotFoundError:
            raise _Miss(f"no kernel cache for key {key} yet") from None
        except ArchiveRefused as exc:
            raise _Miss(str(exc)) from None
        if dir_fd is None:
            raise _Miss(f"kernel cache {key} refused: {why}", refused=True)
        try:
            meta = self._record(key, dir_fd)
            try:
                fd, why = trust.open_trusted(meta["archive"], self.writers, f"its archive {meta['archive']}", dir_fd=dir_fd)
            except FileNotFoundError:
                raise _Miss(f"kernel cache {key}: its archive {meta['archive']} is missing") from None
            if fd is None:
                raise _Miss(f"kernel cache {key} refused: {why}", refused=True)
            size = os.fstat(fd).st_size
            if size != meta["archive_bytes"]:
                os.close(fd)
                raise _Miss(f"kernel cache {key}: archive is {size} bytes, key.json says {meta['archive_bytes']} (damaged)")
            return meta, fd
        finally:
            os.close(dir_fd)

    def _record(self, key: str, dir_fd: int) -> Dict[str, Any]:
        try:
            fd, why = trust.open_trusted(KEY_JSON, self.writers, KEY_JSON, dir_fd=dir_fd)
        except FileNotFoundError:
            raise _Miss(f"no kernel cache for key {key} yet") from None
        if fd is None:
            raise _Miss(f"kernel cache {key} refused: {why}", refused=True)
        try:
            with os.fdopen(fd, "rb") as fh:
                meta = json.loads(fh.read(1 << 20).decode("utf-8"))
        except (OSError, ValueError) as exc:
            raise _Miss(f"kernel cache {key}: key.json cannot be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        why = _validate(meta, key)
        if why:
            raise _Miss(f"kernel cache {key}: {why}")
        return meta

    def restore(self, key: str, dest: Path, max_bytes: int) -> RestoreResult:
        """The key's archive into dest: a hit, or a miss with its reason (never raises)."""
        t0 = time.monotonic()
        try:
            meta, fd = self._open(key)
        except _Miss as miss:
            return RestoreResult("miss", str(miss), refused=miss.refused)
        try:
            with os.fdopen(fd, "rb") as fh:
                sha = hashlib.sha256()  # (hashlib.file_digest is 3.11+)
                while chunk := fh.read(1 << 20):
                    sha.update(chunk)
                digest = sha.hexdigest()
                if digest != meta["archive_sha256"]:  # before a member is read
                    return RestoreResult("miss", f"kernel cache {key} refused: its archive is not the one its writer "
                                         f"recorded (sha256 {digest[:12]}…, key.json says {meta['archive_sha256'][:12]}…)",
                                         seconds=time.monotonic() - t0, refused=True)
                fh.seek(0)
                files, nbytes, kept = extract(fh, dest, max_bytes)
        except ArchiveRefused as exc:
            return RestoreResult("miss", f"kernel cache {key} refused: {exc}", seconds=time.monotonic() - t0, refused=True)
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            return RestoreResult("miss", f"kernel cache {key} is damaged ({type(exc).__name__}: {exc})",
                                 seconds=time.monotonic() - t0)
        if files == 0 and kept == 0:  # an archive of nothing restores nothing: the engine compiles as on a miss
            return RestoreResult("miss", f"kernel cache {key} holds no files", seconds=time.monotonic() - t0)
        mark_used(self.folder(key))  # `store prune` removes the least recently used first
        if files == 0:  # a warm node: what the archive holds is here already; nothing was restored
            return RestoreResult("local", f"the {kept} files of kernel cache {key} are already on this node",
                                 0, 0, time.monotonic() - t0, kept=kept)
        # a node whose key folder is elsewhere (another $HOME, $XDG_CACHE_HOME or MXLAUNCH_KERNEL_CACHE_DIR): the
        # ninja-built modules name the capture's folder; moved, or the engine builds them again
        was = meta.get("captured_in")
        rebased = rebase_tree(dest, Path(was), dest, shutil.which("ninja")) if isinstance(was, str) and os.path.isabs(was) else 0
        return RestoreResult("hit", "", files, nbytes, time.monotonic() - t0, kept=kept, rebased=rebased)

    def capture(self, key: str, fields: Dict[str, Any], src: Path, max_bytes: int, *, model: Optional[str] = None,
                stop: Callable[[], bool] = lambda: False) -> CaptureResult:
        """src's caches → a new archive for key, published atomically by the one holder of the key's claim."""
        t0 = time.monotonic()
        if cache_key(fields) != key:
            return CaptureResult(False, "the fields do not hash to the key (refusing to store under another key)")
        claim = self.coordinator.try_claim(f"kc-{key}", ttl_s=CLAIM_TTL_S)
        if claim is None:
            return CaptureResult(False, "another launch is writing this key's kernel cache")
        claim.keep_alive()
        folder = ensure_dir(self.folder(key))
        tmp = folder / (unique_name(".tmp-") + ".tar")
        try:
            why = self.writers.why_not(os.lstat(folder), f"its folder {folder}", is_dir=True, shared_ok=True)
            if why:  # another user made the key's folder first: what is written there would never be restored
                return CaptureResult(False, f"not captured: {why} — remove it (or ask its owner to)")
            files, nbytes, digest = build_archive(src, tmp, max_bytes, stop)
            if files == 0:  # folders only: restoring it would restore nothing
                return CaptureResult(False, "the cache folders hold no files; nothing to capture")
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            secure(tmp, is_dir=False)
            _no_write_for_others(tmp)
            if claim.lost:
                return CaptureResult(False, "lost the key's claim while writing")
            name = f"cache-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(4)}.tar"
            os.rename(tmp, folder / name)
            meta = {"schema": SCHEMA, "key": key, "fields": fields, "archive": name,
                    "archive_bytes": os.path.getsize(folder / name), "archive_sha256": digest, "files": files,
                    "bytes": nbytes, "model": model, "created_at": _utc_now(), "captured_in": os.path.realpath(src),
                    "created_by": {"host": socket.gethostname(), "mxlaunch": __version__, "uid": os.getuid()}}
            record = write_json_temp(folder, meta, prefix=f".{KEY_JSON}.")
            try:
                _no_write_for_others(record)
                os.replace(record, folder / KEY_JSON)
            finally:
                record.unlink(missing_ok=True)
            for old in folder.iterdir():  # readers that opened an older archive keep their open file
                if old.name != name and _ARCHIVE.match(old.name):
                    old.unlink(missing_ok=True)
            return CaptureResult(True, "", files, nbytes, time.monotonic() - t0)
        except ArchiveRefused as exc:
            return CaptureResult(False, str(exc), seconds=time.monotonic() - t0)
        except OSError as exc:
            return CaptureResult(False, f"cannot write the archive: {exc.strerror or exc}", seconds=time.monotonic() - t0)
        finally:
            tmp.unlink(missing_ok=True)
            claim.release()

    def list(self) -> List[CacheEntry]:
        if not self.root.is_dir():
            return []
        out = []
        for child in sorted(self.root.iterdir()):
            if child.name.startswith(".") or not valid_id(child.name) or not child.is_dir() or child.is_symlink():
                continue
            meta, why = self.lookup(child.name)
            if meta is None:
                try:  # shown, never restored: the record is data here
                    meta = read_json(child / KEY_JSON, limit=1 << 20)
                except (OSError, ValueError):
                    meta = {}
            out.append(CacheEntry(child.name, meta if isinstance(meta, dict) else {}, not why, why,
                                  last_used(child, KEY_JSON)))
        return out

    def remove(self, key: str) -> None:
        """Renamed away first (gone at once for readers), then deleted."""
        folder = self.folder(key)
        if not folder.is_dir() or folder.is_symlink():
            raise FileNotFoundError(key)
        trash = self.root / f".trash-{key}-{secrets.token_hex(4)}"
        os.rename(folder, trash)
        shutil.rmtree(trash)


def _validate(meta: Any, key: str) -> str:
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        return "key.json is not a schema-1 record"
    if meta.get("key") != key:
        return f"key.json is for key {meta.get('key')!r}, not {key} (never restored under another key)"
    if not isinstance(meta.get("fields"), dict) or cache_key(meta["fields"]) != key:
        return "its stored fields do not hash to its key (never restored under another key)"
    if not isinstance(meta.get("archive"), str) or not _ARCHIVE.match(meta["archive"]):
        return "key.json names no valid archive"
    if not isinstance(meta.get("archive_bytes"), int):
        return "key.json has no archive size"
    if not isinstance(meta.get("archive_sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", meta["archive_sha256"]):
        return "key.json records no sha256 of its archive (written by an older mxlaunch): captured again"
    return ""

