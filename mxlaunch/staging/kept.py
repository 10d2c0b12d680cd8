"""Staged snapshots kept in /dev/shm between launches on a node (`launch --keep-staged`).

Why: a restart on the same node — a crashed or upgraded replica, a zygote restart, a lean engine snapshot's
refill — reads the whole snapshot from the store again, though the last launch had it in /dev/shm minutes ago:
on the H200 the lean restore's refill was that read (8 GiB at the local disk's ~1.6 GiB/s, 5 s of its 9-10 s),
and on Lustre it is 140 GB per 70B replica against every other job's reads. SGLang's weight-cache daemon and
vLLM 0.31's `preload` keep weights resident for the same reason. Here the stage's files stay where they are: a
kept entry is hard links to the files a launch staged (no copy, no extra memory while that launch runs), and the
next launch of the same source id links them into its own stage folder instead of reading them (the memory is
then shared by both). Opt-in: the kept files hold their RAM until dropped.

    <user root>/kept/<source id>/files.json    the entry's files: rel → {"bytes", "xxh3_128"} (the store's)
    <user root>/kept/<source id>/<rank>/<file> hard links to what a launch staged, each checked when it landed

Trust: the user root is this user's own 0700 folder (launch/cleanup.user_root), the kept folder too (own_dir);
a file is reused only when it is this user's regular file of the size files.json and the plan both say, under
the same name and checksum the plan asks for. `evict` drops the least recently used entries when a stage needs
the room; `mxlaunch kept --drop` drops them all.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from mxlaunch.fileutil import write_json_atomic
from mxlaunch.safety.ownership import own_dir, private_dir

KEPT = "kept"  # the name in the user root: never a run folder (launch/cleanup.py reaps run folders)
FILES = "files.json"
LOCK = ".lock"
USED = ".last-used"


@dataclass
class Reused:
    """What a launch found kept: the files linked into its stage folder (rel names) and their bytes."""

    rels: list[str]
    bytes: int


def kept_root(user_root: Path) -> Path:
    return user_root / KEPT


def reuse(user_root: Path, source_id: str, expected: Mapping[str, Mapping], dest: Path) -> Reused:
    """Link the kept files of `source_id` that match `expected` (rel → bytes, xxh3_128: the plan's) into
    `dest/<rel>`; what was linked. Nothing kept, or a folder that is not this user's alone: nothing."""
    entry, recorded = _entry(user_root, source_id)
    if not recorded:
        return Reused([], 0)
    rels, total = [], 0
    for rel, want in sorted(expected.items()):
        if not _usable(entry, recorded, rel, want):
            continue
        src = entry / rel
        target = dest / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, target)
        except OSError:  # not linked: the stage reads it
            continue
        rels.append(rel)
        total += int(want["bytes"])
    if rels:
        try:
            (entry / USED).touch()
        except OSError:  # evicted by another launch meanwhile: the links made stand on their own
            pass
    return Reused(rels, total)


def _entry(user_root: Path, source_id: str) -> tuple[Path, dict]:
    """The kept entry of `source_id` and its files.json ({} when there is none, or its folders are not this
    user's alone)."""
    entry = kept_root(user_root) / source_id
    if not (private_dir(kept_root(user_root)) and private_dir(entry)):
        return entry, {}
    try:
        recorded = json.loads((entry / FILES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return entry, {}
    return entry, recorded if isinstance(recorded, dict) else {}


def _inside(rel: str) -> bool:
    """A plan's relative name that stays inside the folder it is joined to."""
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts


def _usable(entry: Path, recorded: dict, rel: str, want: Mapping) -> bool:
    """Whether the kept `rel` is what the plan asks for (name, size, checksum) and a file of this user's alone."""
    if not _inside(rel):
        return False
    have = recorded.get(rel)
    if not isinstance(have, dict) or have.get("xxh3_128") != want.get("xxh3_128") or int(have.get("bytes", -1)) != int(want["bytes"]):
        return False
    try:
        st = os.lstat(entry / rel)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022 \
        and st.st_size == int(want["bytes"])


def available(user_root: Path, source_id: str, expected: Mapping[str, Mapping]) -> int:
    """The bytes `reuse` would link now (a dry run's answer), without linking anything."""
    entry, recorded = _entry(user_root, source_id)
    return sum(int(want["bytes"]) for rel, want in expected.items() if _usable(entry, recorded, rel, want))


def keep(user_root: Path, source_id: str, stage_dir: Path, expected: Mapping[str, Mapping]) -> int:
    """Keep the files a launch staged into `stage_dir` (each checked as it landed) for the next launch of
    `source_id`: hard links under the kept folder, files.json written last. The bytes now kept."""
    entry = own_dir(own_dir(kept_root(user_root)) / source_id)
    lock = os.open(entry / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two launches of one snapshot on the node: one files.json each in turn
        _, recorded = _entry(user_root, source_id)
        for rel, want in sorted(expected.items()):
            src, target = stage_dir / rel, entry / rel
            mine = {"bytes": int(want["bytes"]), "xxh3_128": want.get("xxh3_128")}
            if not _inside(rel) or (recorded.get(rel) == mine and target.exists()):
                continue
            try:
                st = os.lstat(src)
                if not stat.S_ISREG(st.st_mode) or st.st_size != mine["bytes"]:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.unlink(missing_ok=True)
                os.link(src, target)
                os.chmod(target, 0o400)  # read-only, this user's alone whatever the umask (reuse checks it)
            except OSError:
                continue
            recorded[rel] = mine
        write_json_atomic(entry / FILES, recorded, private=True)
        (entry / USED).touch()
    finally:
        os.close(lock)
    return sum(int(v["bytes"]) for v in recorded.values() if isinstance(v, dict))


@dataclass
class Entry:
    source_id: str
    bytes: int
    files: int
    last_used: float


def entries(user_root: Path) -> list[Entry]:
    """The kept entries, least recently used first."""
    root = kept_root(user_root)
    found = []
    for entry in sorted(root.iterdir()) if private_dir(root) else []:
        if not private_dir(entry):
            continue
        try:
            recorded = json.loads((entry / FILES).read_text(encoding="utf-8"))
            used = os.stat(entry / USED).st_mtime if (entry / USED).exists() else os.stat(entry).st_mtime
        except (OSError, ValueError):
            recorded, used = {}, 0.0
        files = [v for v in recorded.values() if isinstance(v, dict)] if isinstance(recorded, dict) else []
        found.append(Entry(entry.name, sum(int(v.get("bytes", 0)) for v in files), len(files), used))
    return sorted(found, key=lambda e: e.last_used)


def drop(user_root: Path, source_id: str) -> None:
    """Remove one kept entry (its memory goes once no launch's stage folder links its files)."""
    entry = kept_root(user_root) / source_id
    if private_dir(kept_root(user_root)) and private_dir(entry):
        shutil.rmtree(entry, ignore_errors=True)


def evict(user_root: Path, need: int, keep_id: Optional[str] = None) -> list[str]:
    """Drop the least recently used entries (never `keep_id`) until `need` bytes were dropped; the ids dropped."""
    dropped, freed = [], 0
    for e in entries(user_root):
        if freed >= need:
            break
        if e.source_id == keep_id:
            continue
        drop(user_root, e.source_id)
        dropped.append(e.source_id)
        freed += e.bytes
    return dropped


def age_s(entry: Entry, now: Optional[float] = None) -> float:
    return max(0.0, (now or time.time()) - entry.last_used)


__all__ = ["Entry", "FILES", "KEPT", "Reused", "age_s", "available", "drop", "entries", "evict", "keep", "kept_root",
           "reuse"]
