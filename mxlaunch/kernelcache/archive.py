"""JIT kernel caches in the artifact store: one tar archive per key, checked before anything is written.

    <store>/kernel-cache/<key>/key.json              the key's fields + which archive is current (atomic rename)
    <store>/kernel-cache/<key>/cache-<id>.tar        the archive (written under .tmp-*, renamed when complete)
    <store>/.claims/kc-<key>/                        one writer per key (coord/file.py claims)

Restore never fails a launch: a missing, damaged, oversized or foreign archive is a miss with a one-line
reason. Every member is checked before the first byte is written (relative names only, no `..`, no links
or devices — regular files and folders only — and a size cap), and the stored fields must hash to the key
asked for: a cache is never restored under another key.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, List, Optional, Tuple

from mxlaunch import __version__
from mxlaunch.coord.base import Coordinator, valid_id
from mxlaunch.fileutil import ensure_dir, last_used, mark_used, read_json, secure, unique_name, write_json_atomic
from mxlaunch.kernelcache.caches import cache_key
from mxlaunch.store.snapshot import _utc_now

KC_DIR = "kernel-cache"
KEY_JSON = "key.json"
SCHEMA = 1
MAX_MEMBERS = 500_000
CLAIM_TTL_S = 60.0
_ARCHIVE = re.compile(r"^cache-[A-Za-z0-9_-]{1,64}\.tar$")


class ArchiveRefused(Exception):
    """The archive cannot be restored; str() is the one-line reason."""


@dataclass
class RestoreResult:
    status: str  # "hit" (files restored) | "local" (every file already on this node) | "miss"
    reason: str = ""
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    kept: int = 0  # files of the archive already on this node (left as they were)


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


# ---- member checks ------------------------------------------------------------------------------------


def check_members(tar: tarfile.TarFile, max_bytes: int) -> List[tarfile.TarInfo]:
    """Every member, checked before anything is extracted; raises ArchiveRefused with the first problem."""
    members, total = [], 0
    for m in tar:  # reads every header (a truncated archive raises here)
        name = m.name
        parts = PurePosixPath(name).parts
        if not name or name.startswith("/") or re.match(r"^[A-Za-z]:", name) or "\\" in name:
            raise ArchiveRefused(f"member {name!r} has an absolute or non-POSIX path")
        if ".." in parts:
            raise ArchiveRefused(f"member {name!r} climbs out of the folder with '..'")
        if not (m.isreg() or m.isdir()):
            kind = "a link" if (m.issym() or m.islnk()) else "not a regular file or folder"
            raise ArchiveRefused(f"member {name!r} is {kind}")
        total += m.size if m.isreg() else 0
        if total > max_bytes:
            raise ArchiveRefused(f"the archive holds more than the {max_bytes / (1 << 30):.1f} GiB cap "
                                 "(MXLAUNCH_KERNEL_CACHE_MAX_GIB)")
        members.append(m)
        if len(members) > MAX_MEMBERS:
            raise ArchiveRefused(f"the archive has more than {MAX_MEMBERS} members")
    return members


def _inside(root: Path, path: Path) -> bool:
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root


def extract(archive: Path, dest: Path, max_bytes: int) -> Tuple[int, int, int]:
    """Check every member, then write them under dest (each file by rename: never half a file). Files
    already there with the same size are kept. Returns (files, bytes) written and the files kept."""
    files = nbytes = kept = 0
    with tarfile.open(archive, "r:") as tar:
        members = check_members(tar, max_bytes)
        ensure_dir(dest)
        for m in members:
            target = dest / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                if not _inside(dest, target):
                    raise ArchiveRefused(f"{target} leads out of {dest} (a link on this node)")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if not _inside(dest, target.parent) or target.is_symlink():
                raise ArchiveRefused(f"{target} leads out of {dest} (a link on this node)")
            if target.is_file() and target.stat().st_size == m.size:
                kept += 1
                continue
            src = tar.extractfile(m)
            assert src is not None
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
            try:
                with src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                    if out.tell() != m.size:
                        raise ArchiveRefused(f"member {m.name!r} is truncated")
                os.chmod(tmp, (m.mode & 0o755) | 0o600)
                os.utime(tmp, (m.mtime, m.mtime))
                os.replace(tmp, target)
            finally:
                if tmp.exists():
                    tmp.unlink()
            files += 1
            nbytes += m.size
    return files, nbytes, kept


def build_archive(src: Path, out: Path, max_bytes: int, stop: Callable[[], bool] = lambda: False) -> Tuple[int, int]:
    """A tar of src's regular files and folders (links and special files left out), owner fields cleared.
    Returns (files, bytes); raises ArchiveRefused over the cap or when stopped."""
    files = nbytes = 0

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w:", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
            rel_dir = os.path.relpath(dirpath, src)
            if rel_dir != ".":
                tar.add(dirpath, arcname=rel_dir, recursive=False, filter=clean)
            for name in sorted(filenames):
                if stop():
                    raise ArchiveRefused("stopped")
                path = os.path.join(dirpath, name)
                if name.endswith(".part") or not os.path.isfile(path) or os.path.islink(path):
                    continue
                size = os.path.getsize(path)
                if nbytes + size > max_bytes:
                    raise ArchiveRefused(f"the caches hold more than the {max_bytes / (1 << 30):.1f} GiB cap "
                                         "(MXLAUNCH_KERNEL_CACHE_MAX_GIB)")
                tar.add(path, arcname=os.path.normpath(os.path.join(rel_dir, name)), recursive=False, filter=clean)
                files += 1
                nbytes += size
    return files, nbytes


# ---- the store's kernel-cache folder ------------------------------------------------------------------


class KernelCacheStore:
    def __init__(self, store_root: Path, coordinator: Coordinator) -> None:
        self.root = Path(store_root) / KC_DIR
        self.coordinator = coordinator

    def folder(self, key: str) -> Path:
        if not valid_id(key):
            raise ArchiveRefused(f"{key!r} is not a valid kernel cache key")
        return self.root / key

    def lookup(self, key: str) -> Tuple[Optional[Dict[str, Any]], str]:
        """(key.json, "") when the key has a usable archive; (None, one-line reason) otherwise. Never raises."""
        try:
            folder = self.folder(key)
            meta = read_json(folder / KEY_JSON, limit=1 << 20)
        except FileNotFoundError:
            return None, f"no kernel cache for key {key} yet"
        except (OSError, ValueError, ArchiveRefused) as exc:
            return None, f"kernel cache {key}: key.json cannot be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        why = _validate(meta, key)
        if why:
            return None, f"kernel cache {key}: {why}"
        try:
            size = os.lstat(folder / meta["archive"]).st_size
        except OSError:
            return None, f"kernel cache {key}: its archive {meta['archive']} is missing"
        if size != meta["archive_bytes"]:
            return None, f"kernel cache {key}: archive is {size} bytes, key.json says {meta['archive_bytes']} (damaged)"
        return meta, ""

    def restore(self, key: str, dest: Path, max_bytes: int) -> RestoreResult:
        """The key's archive into dest: a hit, or a miss with its reason (never raises)."""
        t0 = time.monotonic()
        meta, why = self.lookup(key)
        if meta is None:
            return RestoreResult("miss", why)
        try:
            files, nbytes, kept = extract(self.folder(key) / meta["archive"], dest, max_bytes)
        except ArchiveRefused as exc:
            return RestoreResult("miss", f"kernel cache {key} refused: {exc}", seconds=time.monotonic() - t0)
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            return RestoreResult("miss", f"kernel cache {key} is damaged ({type(exc).__name__}: {exc})",
                                 seconds=time.monotonic() - t0)
        if files == 0 and kept == 0:  # an archive of nothing restores nothing: the engine compiles as on a miss
            return RestoreResult("miss", f"kernel cache {key} holds no files", seconds=time.monotonic() - t0)
        mark_used(self.folder(key))  # `store prune` removes the least recently used first
        if files == 0:  # a warm node: what the archive holds is here already; nothing was restored
            return RestoreResult("local", f"the {kept} files of kernel cache {key} are already on this node",
                                 0, 0, time.monotonic() - t0, kept=kept)
        return RestoreResult("hit", "", files, nbytes, time.monotonic() - t0, kept=kept)

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
            files, nbytes = build_archive(src, tmp, max_bytes, stop)
            if files == 0:  # folders only: restoring it would restore nothing
                return CaptureResult(False, "the cache folders hold no files; nothing to capture")
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            secure(tmp, is_dir=False)
            if claim.lost:
                return CaptureResult(False, "lost the key's claim while writing")
            name = f"cache-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(4)}.tar"
            os.rename(tmp, folder / name)
            meta = {"schema": SCHEMA, "key": key, "fields": fields, "archive": name,
                    "archive_bytes": os.path.getsize(folder / name), "files": files, "bytes": nbytes, "model": model,
                    "created_at": _utc_now(), "created_by": {"host": socket.gethostname(), "mxlaunch": __version__}}
            write_json_atomic(folder / KEY_JSON, meta)
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
                try:
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
    return ""

