"""Will the bytes fit? Free space on the destination AND the memory limit tmpfs pages count against.

tmpfs pages are charged to the writer's memory cgroup, so a stage into /dev/shm that fits the
filesystem can still get the job OOM-killed: Slurm's job memory and cgroup v2 `memory.max`
(or v1 `memory.limit_in_bytes`) must have room too, after what the engine itself will need. The
filesystem's type also picks the pager (`tmpfs_pager`: 2 MiB pages only where tmpfs can collapse them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from mxlaunch.memory.hugepages import HugePager

# Filesystems whose pages live in RAM (and so in the memory cgroup).
MEMORY_BACKED_FS = {"tmpfs", "ramfs", "shm"}
_UNLIMITED = 1 << 60
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Capacity:
    """What a destination can take, and which limit is the tightest."""

    path: str
    fs_type: str
    fs_free: int
    memory_backed: bool
    cgroup_headroom: int | None  # None: no cgroup memory limit found
    ram_available: int

    @property
    def usable(self) -> int:
        limits = [self.fs_free]
        if self.memory_backed:
            limits.append(self.ram_available)
            if self.cgroup_headroom is not None:
                limits.append(self.cgroup_headroom)
        return max(0, min(limits))

    @property
    def binding_limit(self) -> str:
        """Name of the limit that sets `usable` (for error messages)."""
        if self.memory_backed:
            if self.cgroup_headroom is not None and self.cgroup_headroom <= min(self.fs_free, self.ram_available):
                return "the job's memory limit (cgroup)"
            if self.ram_available < self.fs_free:
                return "available RAM"
        return f"free space on {self.path}"


def fs_type_of(path: str | os.PathLike[str]) -> str:
    """Filesystem type of the mount holding `path` (longest matching mount point)."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (target == mp or target.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best, best_type = mp, part.fstype
    return best_type


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory_headroom(proc_cgroup: str = "/proc/self/cgroup", root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process may still charge before its tightest memory cgroup limit, or None.

    Walks from this process's cgroup up to the root (a parent's limit binds too). Handles cgroup v2
    (`memory.max` − `memory.current`) and v1 (`memory.limit_in_bytes` − `memory.usage_in_bytes`).
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates: list[tuple[Path, str, str]] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.lstrip("/")
        if hier == "0" and controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            candidates.append((base / rel, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((root / "memory" / rel, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: int | None = None
    for leaf, limit_name, usage_name in candidates:
        node = leaf
        while True:
            limit = _read_int(node / limit_name)
            usage = _read_int(node / usage_name)
            if limit is not None and limit < _UNLIMITED // 2:
                room = max(0, limit - (usage or 0))
                best = room if best is None else min(best, room)
            if node == root or node.parent == node or root not in node.parents:
                break
            node = node.parent
    return best


def capacity_of(dest: str | os.PathLike[str]) -> Capacity:
    """Measure what `dest` (an existing directory, or its nearest existing parent) can take."""
    probe = Path(dest)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    fs_type = fs_type_of(probe)
    return Capacity(
        path=str(probe),
        fs_type=fs_type,
        fs_free=st.f_bavail * st.f_frsize,
        memory_backed=fs_type in MEMORY_BACKED_FS,
        cgroup_headroom=cgroup_memory_headroom(),
        ram_available=psutil.virtual_memory().available,
    )


def format_bytes(n: float) -> str:
    """Human-readable binary size (GiB/MiB/KiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str) -> int:
    """'16MiB', '4k', '1G', '123' → bytes (binary units; K/M/G/T with optional 'iB'/'B')."""
    s = text.strip().lower().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    num = s.rstrip("kmgtib")
    suffix = s[len(num):].replace("ib", "").replace("b", "")
    if suffix not in units or not num:
        raise ValueError(f"cannot read size {text!r}: use e.g. 16MiB, 4KiB, 1GiB")
    try:
        value = float(num)
    except ValueError as exc:
        raise ValueError(f"cannot read size {text!r}: use e.g. 16MiB, 4KiB, 1GiB") from exc
    return int(value * units[suffix])


def tmpfs_pager(dest: "str | os.PathLike[str]", lands_in_mapping: bool) -> Optional[HugePager]:
    """The pager for a job writing under `dest`: one when it is tmpfs (ramfs has no huge pages), else None. Its
    cost limit is what 4 KiB pages cost the way the bytes land: 0.9 CPU s/GiB when they land in the mapping
    (each page faulted in and zeroed), 0.3 when they are copied in with pwrite (see HugePager)."""
    if fs_type_of(dest) not in MEMORY_BACKED_FS - {"ramfs"}:
        return None
    return HugePager(max_cpu_s_per_gib=0.9 if lands_in_mapping else 0.3)
