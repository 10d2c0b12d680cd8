"""The snapshot's files: plain safetensors, written by mxlaunch so tensors stream without a second copy.

An 8-byte header length, a JSON header padded to 8 bytes, then each tensor's bytes in order. Parts hold
at most `PART_BYTES` (a larger tensor gets a part of its own); names are `part-%05d.safetensors`,
deterministic for a given model. `read_header` checks a header against the file before a byte of it is
trusted: offsets inside the file, sizes that match shape and dtype, known dtypes, aliases well formed.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from mxlaunch.plugin.tensors import _CODES, _DTYPES, CaptureError, Group, SnapshotCorrupt, tensor_bytes

PART_BYTES = 1 << 30
PART_NAME = "part-{:05d}.safetensors"
ALIASES_KEY = "mxlaunch.aliases"
SCHEMA_KEY = "mxlaunch.schema"
MAX_HEADER = 100 << 20


def _header(part: list[Group], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for g in part:
        t = g.tensor
        if t.dtype not in _DTYPES:
            raise CaptureError(f"tensor {g.name} has dtype {t.dtype}, which safetensors cannot hold")
        n = t.numel() * t.element_size()
        header[g.name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw



@dataclass
class FileEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass
class FileHeader:
    path: Path
    size: int
    entries: list[FileEntry]
    aliases: dict[str, list[str]] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(e.end - e.begin for e in self.entries)


def read_header(path: str | os.PathLike[str], expected_size: int | None = None) -> FileHeader:
    """Parse and check a safetensors header against the file's size; SnapshotCorrupt when it is wrong."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if expected_size and size != expected_size:
                raise SnapshotCorrupt(f"{p} is {size} bytes, the snapshot says {expected_size}")
            head = fh.read(8)
            if len(head) < 8:
                raise SnapshotCorrupt(f"{p} is too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise SnapshotCorrupt(f"{p}: header length {n} does not fit the file ({size} bytes)")
            raw = fh.read(n)
    except OSError as exc:
        raise SnapshotCorrupt(f"cannot read {p}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotCorrupt(f"{p}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SnapshotCorrupt(f"{p}: the safetensors header is not a JSON object")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    entries: list[FileEntry] = []
    try:
        for name, spec in header.items():
            code = spec["dtype"]
            if code not in _CODES:
                raise SnapshotCorrupt(f"{p}: tensor {name} has unsupported dtype {code}")
            dtype = _CODES[code]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            if begin < 0 or end - begin != numel * dtype.itemsize or base + end > size:
                raise SnapshotCorrupt(f"{p}: tensor {name} has offsets [{begin}, {end}] that do not fit its "
                                      f"shape {list(shape)} {code} or the file ({size} bytes)")
            entries.append(FileEntry(name, dtype, shape, base + begin, base + end))
        aliases = json.loads(meta[ALIASES_KEY]) if ALIASES_KEY in meta else {}
        if not isinstance(aliases, dict):
            raise SnapshotCorrupt(f"{p}: metadata {ALIASES_KEY} is not a JSON object")
    except SnapshotCorrupt:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotCorrupt(f"{p}: malformed safetensors header ({exc!r})") from exc
    return FileHeader(p, size, entries, {str(k): [str(a) for a in v] for k, v in aliases.items()})


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, on CPU and contiguous (a copy only when it has to be)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor_bytes(t).numpy())


def write_cpu_tensor(fh: BinaryIO, tensor: torch.Tensor) -> int:
    data = _tensor_bytes(tensor)
    fh.write(data)
    return len(data)
