"""Lustre file layouts: parse `lfs getstripe` output and say which OST serves each byte range.

A big checkpoint on Lustre is striped over OSTs; reading it fast means keeping every OST busy, not
hammering one. `lfs` is called only when it is on PATH and the file is on a Lustre mount. Both the
plain output and `-y` YAML are understood, for plain (single-layout) files and PFL composite
layouts; for FLR mirrored files the first mirror is used. Offsets map to OSTs as Lustre's RAID0 does
(lov_stripe_number): stripe = (offset // stripe_size) % stripe_count, within the covering component.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

EOF_END = 1 << 63


@dataclass
class Component:
    """One layout component: a byte extent striped RAID0 over `osts` (empty: not instantiated)."""

    start: int = 0
    end: int = EOF_END
    stripe_size: int = 1 << 20
    stripe_count: int = 1
    osts: list[int] = field(default_factory=list)
    mirror_id: int = 0

    def ost_for(self, offset: int) -> int | None:
        if not self.osts:
            return None
        return self.osts[(offset // self.stripe_size) % len(self.osts)]


@dataclass
class Layout:
    """A file's layout: components in file order."""

    components: list[Component]

    def component_at(self, offset: int) -> Component | None:
        for comp in self.components:
            if comp.start <= offset < comp.end:
                return comp
        return None

    def ost_for(self, offset: int) -> int | None:
        comp = self.component_at(offset)
        return comp.ost_for(offset) if comp else None

    def stripe_end(self, offset: int) -> int:
        """End (exclusive) of the stripe unit holding `offset`: reads cut here touch one OST."""
        comp = self.component_at(offset)
        if comp is None or not comp.osts:
            return EOF_END
        size = comp.stripe_size
        return min(comp.end, (offset // size + 1) * size)

    @property
    def ost_set(self) -> set[int]:
        return {ost for comp in self.components for ost in comp.osts}


_KV = re.compile(r"^\s*-?\s*([A-Za-z_.]+):\s*(.*?)\s*$")
_OST_IDX = re.compile(r"l_ost_idx:\s*(\d+)")
_OBD_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(0x[0-9a-fA-F]+|\d+)\s+(0x[0-9a-fA-F]+|\d+)\s*$")


def _int(value: str) -> int:
    value = value.strip().strip(",")
    if value.upper() == "EOF":
        return EOF_END
    return int(value, 0)


def parse_getstripe(text: str) -> Layout:
    """Parse `lfs getstripe FILE` or `lfs getstripe -y FILE` output into a Layout.

    Raises ValueError when the text holds no layout (e.g. an error message or a directory default).
    """
    components: list[Component] = []
    current: Component | None = None
    composite = False
    in_obd_table = False
    saw_stripe = False
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        if "obdidx" in line and "objid" in line:
            in_obd_table = True
            continue
        if in_obd_table:
            row = _OBD_ROW.match(line)
            if row and current is not None:
                current.osts.append(int(row.group(1)))
                continue
            in_obd_table = False
        for idx in _OST_IDX.findall(line):
            if current is not None:
                current.osts.append(int(idx))
        match = _KV.match(line)
        if not match:
            continue
        key, value = match.group(1), match.group(2)
        if key == "lcm_entry_count":
            composite = True
        elif key == "lcme_id":
            current = Component()
            components.append(current)
        elif key == "lcme_mirror_id" and current is not None:
            current.mirror_id = _int(value)
        elif key == "lcme_extent.e_start" and current is not None:
            current.start = _int(value)
        elif key == "lcme_extent.e_end" and current is not None:
            current.end = _int(value)
        elif key == "lmm_stripe_count":
            if current is None:
                current = Component()
                components.append(current)
            current.stripe_count = _int(value)
            saw_stripe = True
        elif key == "lmm_stripe_size" and current is not None:
            current.stripe_size = _int(value)
    if not saw_stripe or not components:
        raise ValueError("no Lustre layout found in lfs getstripe output")
    if composite:
        first_mirror = min(c.mirror_id for c in components)
        components = [c for c in components if c.mirror_id == first_mirror]
    for comp in components:
        if comp.stripe_size <= 0:
            raise ValueError(f"bad stripe size {comp.stripe_size} in lfs getstripe output")
    return Layout(components=sorted(components, key=lambda c: c.start))


def lfs_available() -> bool:
    return shutil.which("lfs") is not None


def is_on_lustre(path: str | Path) -> bool:
    from mxlaunch.staging.capacity import fs_type_of

    return fs_type_of(path) == "lustre"


def layout_of(path: str | Path, timeout: float = 30.0) -> Layout | None:
    """The file's layout via `lfs getstripe`, or None when not on Lustre / lfs missing / it fails."""
    if not lfs_available() or not is_on_lustre(path):
        return None
    try:
        proc = subprocess.run(
            ["lfs", "getstripe", str(path)], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    try:
        return parse_getstripe(proc.stdout)
    except ValueError:
        return None


def layouts_of(paths: list[Path]) -> list[Layout | None] | None:
    """Every file's layout when they are on Lustre (one statfs decides, off Lustre nothing more is asked),
    for the OST-aware schedule; None when there is no Lustre, no `lfs`, or no layout could be read."""
    if not paths or not lfs_available() or not is_on_lustre(paths[0]):
        return None
    layouts = [layout_of(p) for p in paths]
    return layouts if any(layouts) else None
