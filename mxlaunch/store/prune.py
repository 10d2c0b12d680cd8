"""Pruning the artifact store: what nobody can use any more, and what nobody has used lately.

A shared store only grows: every model, engine version and parallel layout adds a snapshot, every
compile key a kernel cache, and a capture killed before it published leaves its parts behind. What goes:

- **leftovers, always**: the parts of unpublished captures whose claim is over (`data-*`, `.tmp-*`,
  `.nodes-*` of a capture that will never publish), what interrupted removals left (`.trash-*`, older
  than `TRASH_AGE_S`), and snapshot folders with nothing left in them;
- **with `unused_for`**: published snapshots, kernel caches and this user's zygote images whose last use is
  older than that;
- **with `max_bytes`**: then the least recently used of those until the store fits;
- and P2P source records in the store's file registry (`.peers`) stale for longer than `peer_grace_s`
  (what `mxlaunch peers --reap` does; a Redis registry is left to that command).

Last use is the mtime of `.last-used` in the folder (fileutil.mark_used), stamped by every launch that
stages or pulls the snapshot or restores the kernel cache; a folder never stamped counts from when it was
made (its manifest or key record). Every removal holds the thing's claim — the one a capture takes — so
a capture in progress is never touched: claimed items are skipped and reported. A launch that is staging
a snapshot while it is removed keeps reading the files it opened; one that had not opened them yet falls
back to the engine's loader (the usual fallback rules). `dry_run` decides the same and changes nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from mxlaunch.coord.base import valid_id
from mxlaunch.coord.peers_file import PEERS_DIR, FileRegistry
from mxlaunch.coord.peers_record import reapable
from mxlaunch.errors import MxlaunchError
from mxlaunch.fileutil import LAST_USED, last_used
from mxlaunch.kernelcache.archive import KEY_JSON, KernelCacheStore
from mxlaunch.safety.ownership import private_dir
from mxlaunch.store import zygote_images
from mxlaunch.store.core import ENGINE_SNAPSHOTS, NOT_SNAPSHOTS, Store
from mxlaunch.store.capture import _du, capture_ids
from mxlaunch.store.snapshot import MANIFEST

TRASH_AGE_S = 600.0  # a `.trash-*` younger than this may still be being deleted by its `store rm`
PEER_GRACE_S = 300.0  # a P2P record stale this long is gone for good (a gone process's at once)
CLAIM_TTL_S = 120.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w', '3600' → seconds."""
    m = _DURATION.match(text.lower())
    if not m:
        raise ValueError(f"cannot read duration {text!r}: use e.g. 30d, 12h, 90m")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass
class Item:
    """One thing the prune removes (or would, or could not)."""

    kind: str  # snapshot | kernel-cache | zygote-image | capture | trash | empty
    name: str  # the source id, the key, "<source id>/<capture id>", or the folder's name
    path: Path
    bytes: int
    why: str
    last_used: Optional[float] = None
    skipped: str = ""  # why it stays after all (claimed, failed); empty when removed

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "path": str(self.path), "bytes": self.bytes,
                "why": self.why, "last_used": self.last_used, "skipped": self.skipped or None}


@dataclass
class PruneReport:
    root: Path
    dry_run: bool
    bytes_before: int
    items: list[Item] = field(default_factory=list)
    stale_peer_records: int = 0  # removed (or, dry, that would be)

    @property
    def removed(self) -> list[Item]:
        return [i for i in self.items if not i.skipped]

    @property
    def freed(self) -> int:
        return sum(i.bytes for i in self.removed)

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root), "dry_run": self.dry_run, "bytes_before": self.bytes_before,
                "bytes_freed": self.freed, "bytes_after": self.bytes_before - self.freed,
                "stale_peer_records": self.stale_peer_records, "removed": [i.to_dict() for i in self.removed],
                "skipped": [i.to_dict() for i in self.items if i.skipped]}


def prune(store: Store, *, unused_for: Optional[float] = None, max_bytes: Optional[int] = None,
          dry_run: bool = False, now: Optional[float] = None, peer_grace_s: float = PEER_GRACE_S) -> PruneReport:
    """Decide and (unless dry_run) remove; see the module docstring for what goes."""
    now = time.time() if now is None else now
    root = store.root
    report = PruneReport(root, dry_run, _du(root) if root.is_dir() else 0)
    if not root.is_dir():
        return report
    caches = KernelCacheStore(root, store.coordinator)
    report.items += _trash(root, now) + _trash(caches.root, now)
    report.items += _leftover_captures(store)
    kept = _in_use(store, caches)
    report.items += by_age_and_size(kept, report, now, unused_for, max_bytes)
    for item in report.items:
        _carry_out(store, caches, item, dry_run)
    if not dry_run:  # what the removals above emptied, and what was empty already
        empties = _empty_folders(store)
        for item in empties:
            _carry_out(store, caches, item, dry_run)
        report.items += empties
    report.stale_peer_records = _stale_peer_records(root, peer_grace_s, dry_run)
    return report


def _age(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f}".removesuffix(".0") + unit
    return f"{seconds:.0f}s"


# ---- what there is ----------------------------------------------------------------------------------

def _trash(folder: Path, now: float) -> list[Item]:
    items = []
    for child in _children(folder):
        if child.name.startswith(".trash-") and child.is_dir() and not child.is_symlink():
            try:
                age = now - child.lstat().st_mtime
            except OSError:
                continue
            if age >= TRASH_AGE_S:
                items.append(Item("trash", child.name, child, _du(child), f"left by an interrupted removal {_age(age)} ago"))
    return items


def _snapshot_folders(store: Store) -> list[Path]:
    return [c for c in _children(store.root) if valid_id(c.name) and c.name not in NOT_SNAPSHOTS and c.is_dir()
            and not c.is_symlink()]


def _leftover_captures(store: Store) -> list[Item]:
    """Unpublished captures; whether their claim is over is checked when removing (under the claim)."""
    items = []
    for folder in _snapshot_folders(store):
        published = store._published_capture(folder.name)
        if published == "?":  # unreadable manifest: every data folder may be the snapshot's
            continue
        ids = capture_ids(_names(folder)) - {published}
        for cid in sorted(ids):
            parts = [folder / f"{p}{cid}" for p in ("data-", ".tmp-", ".nodes-")]
            items.append(Item("capture", f"{folder.name}/{cid}", folder, sum(_du(p) for p in parts if p.is_dir()),
                              "unpublished capture, its claim over"))
    return items


def _in_use(store: Store, caches: KernelCacheStore) -> list[Item]:
    """Published snapshots and kernel caches, each with its last use: what age and size may remove."""
    items = []
    for folder in _snapshot_folders(store):
        if (folder / MANIFEST).is_file():
            items.append(Item("snapshot", folder.name, folder, _du(folder), "", last_used(folder, MANIFEST)))
    for folder in _children(caches.root):
        if valid_id(folder.name) and folder.is_dir() and not folder.is_symlink():
            items.append(Item("kernel-cache", folder.name, folder, _du(folder), "", last_used(folder, KEY_JSON)))
    return items + warm_images(store)


def warm_images(store: Store) -> list[Item]:
    """This user's zygote images and lean engine snapshots in the store, each with its size and last use (`store
    list` shows them; age and size may remove them). Others' are in their own 0700 folders: theirs to see."""
    items = []
    images = zygote_images.images_root(store.root)
    for folder in _children(images) if private_dir(images) else []:
        if valid_id(folder.name) and folder.is_dir() and not folder.is_symlink():
            items.append(Item("zygote-image", folder.name, folder, _du(folder), "",
                              last_used(folder, zygote_images.META)))
    engines = store.root / ENGINE_SNAPSHOTS / str(os.getuid())
    for folder in _children(engines) if private_dir(engines) else []:
        if valid_id(folder.name) and folder.is_dir() and not folder.is_symlink():
            items.append(Item("engine-snapshot", folder.name, folder, _du(folder), "", last_used(folder, "meta.json")))
    return items


def _empty_folders(store: Store) -> list[Item]:
    """Snapshot folders with nothing left (no manifest, no capture, at most a stamp)."""
    return [Item("empty", f.name, f, 0, "an empty snapshot folder") for f in _snapshot_folders(store)
            if not set(_names(f)) - {LAST_USED}]


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


# ---- removing, each under its claim -------------------------------------------------------------------

def _carry_out(store: Store, caches: KernelCacheStore, item: Item, dry_run: bool) -> bool:
    """Remove one item (or, dry, check that it could be); sets `item.skipped` when it stays."""
    if item.kind == "trash":
        if not dry_run:
            shutil.rmtree(item.path, ignore_errors=True)
        return True
    claim_id = {"kernel-cache": f"kc-{item.name}", "zygote-image": f"zi-{item.name}",
                "engine-snapshot": f"es-{item.name}"}.get(item.kind,
                                                                                          item.name.split("/")[0])
    if dry_run:
        holder = store.coordinator.holder(claim_id)
        if holder is not None:
            item.skipped = f"claimed by {holder.describe()}"
        return not item.skipped
    claim = store.coordinator.try_claim(claim_id, ttl_s=CLAIM_TTL_S, extra={"pruning": True})
    if claim is None:
        holder = store.coordinator.holder(claim_id)
        item.skipped = f"claimed by {holder.describe()}" if holder else "its claim is held"
        return False
    try:
        remove: Callable[[], Any] = {
            "snapshot": lambda: store.remove(item.name, force=True),
            "kernel-cache": lambda: caches.remove(item.name),
            "capture": lambda: store.discard_capture(*item.name.split("/", 1)),
            "empty": lambda: _rmdir_empty(item.path),
            "zygote-image": lambda: shutil.rmtree(item.path),
            "engine-snapshot": lambda: shutil.rmtree(item.path),
        }[item.kind]
        remove()
    except (OSError, ValueError, RuntimeError, MxlaunchError) as exc:
        item.skipped = f"could not remove it: {exc}"
    finally:
        claim.release()
    return not item.skipped


def _stale_peer_records(root: Path, grace_s: float, dry_run: bool) -> int:
    if not (root / PEERS_DIR).is_dir():
        return 0
    registry = FileRegistry(root)
    if dry_run:
        return sum(reapable(e, grace_s) for e in registry.all_sources(include_stale=True))
    return registry.reap(grace_s=grace_s)


def _rmdir_empty(folder: Path) -> None:
    if set(_names(folder)) - {LAST_USED}:
        raise RuntimeError("no longer empty")
    (folder / LAST_USED).unlink(missing_ok=True)
    folder.rmdir()


def by_age_and_size(kept: list, report: "PruneReport", now: float, unused_for: Optional[float],
                    max_bytes: Optional[int], since: str = "unused for {age}") -> list:
    """Of the items in use, those to prune: unused for longer than `unused_for`, then the least recently used
    until the store fits `max_bytes` (what `report` already prunes counted out). Both stores prune by it; an
    S3 store counts `since` its upload."""
    out: list = []
    if unused_for is not None:
        for item in kept:
            if item.last_used is not None and item.last_used < now - unused_for:
                item.why = f"{since.format(age=_age(now - item.last_used))} (--unused-for {_age(unused_for)})"
                out.append(item)
    if max_bytes is not None:
        size = report.bytes_before - sum(i.bytes for i in report.items) - sum(i.bytes for i in out)
        for item in sorted((i for i in kept if i not in out), key=lambda i: i.last_used or 0.0):
            if size <= max_bytes:
                break
            item.why = f"least recently used ({_age(now - (item.last_used or now))} ago), store over --max-size"
            out.append(item)
            size -= item.bytes
    return out
