"""Source id: which per-rank snapshot (or serving peer) a launch may take its weights from.

source id = the first 16 hex digits of sha256 over the canonical JSON (sorted keys, compact, every
string lower-cased) of `identity_fields(...)` — everything that fixes the tensors one rank holds:

- **model identity**: the resolved model directory AND a fingerprint of the checkpoint in it, so that
  an overwritten checkpoint never serves a stale snapshot (see `checkpoint_fingerprint`); when the
  directory is a hub-cache snapshot (`.../models--org--name/snapshots/<commit>`) its commit is in the
  fingerprint too. A model that did not resolve to a directory is identified by its name only (such a
  launch runs the default strategy anyway: `LaunchSpec.unsafe_reasons` says why).
- **engine and its version** (a login node without the engine gets `null`, hence another id: only the
  id computed where the engine is installed is used to look up snapshots).
- **device type** (cpu / cuda / ...): backends lay tensors out differently.
- **parallelism that partitions weights**: `tp` and `pp` always. Data parallelism does not change what
  a rank holds while it only makes replicas: every DP replica loads the same TP×PP shards, so `dp` is
  left out — one snapshot serves any number of replicas. Expert parallelism does partition weights:
  with it the experts are split over the EP group (vLLM: tp × dp ranks; SGLang: --ep-size), so the EP
  size is included, and through it the DP size whenever EP is on. `ep` is 1 when experts are not split
  over EP (then they are TP-sharded like any other layer).
- **dtype and quantization** as given (dtype "auto" is pinned by config.json, which is fingerprinted).
- engine-specific layout settings (`LaunchSpec.layout_extras`: vLLM --hf-overrides, --model-impl).
- **snapshot format and its version** (a new on-disk format never reads an old snapshot).

Not in the id, on purpose: host/port, served name, node placement (nnodes/node_rank only say which
ranks a node hosts), the load format and loader config (how weights are read, not what they are), and
anything else that leaves the tensors as they are (max-model-len, KV-cache settings, ...).

The fingerprint reads only small things: config.json and the other layout JSON files, *.py files
(trust-remote-code model code), and each *.safetensors file's header (the first 8 bytes give its
length N, then N bytes of JSON: names, dtypes, shapes, offsets) — never the tensors. Each weight
file's size and mtime_ns are included, so rewriting a tensor's bytes in place changes the id through
the mtime even when the header stays the same. Copying a checkpoint without keeping mtimes (cp
without -p) therefore gives a new id and a new capture: safe, just not free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Dict, Optional

from mxlaunch.contract import SNAPSHOT_VERSION
from mxlaunch.engines.base import LaunchSpec

SNAPSHOT_FORMAT = "raw"  # the default for callers that name none; the launcher passes contract's names
ID_HEX = 16
MAX_HEADER = 100 * 1024 * 1024  # safetensors refuses headers above 100 MB; a bigger length means a broken file

# top-level files whose content fixes the layout (besides config.json): shard indexes, quantization
# configs, Mistral-format params.json
_LAYOUT_JSON = re.compile(r"^(.*\.index\.json|.*quant.*\.json|params\.json|adapter_config\.json)$", re.IGNORECASE)
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--[^/]+/snapshots/([^/]+)/?$")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def safetensors_header_hash(path: Path) -> str:
    """sha256 of a safetensors file's 8-byte length and its JSON header (the tensors are not read).

    A file too short for its declared header hashes what is there and is marked "truncated:" — the
    engine will refuse such a file itself; the id only has to differ from the good file's.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "truncated:" + hashlib.sha256(head).hexdigest()
        (n,) = struct.unpack("<Q", head)
        body = f.read(min(n, MAX_HEADER))
    h = hashlib.sha256(head + body).hexdigest()
    return h if len(body) == n else "truncated:" + h


def hub_revision(model_path: Optional[str]) -> Optional[str]:
    """The commit of a hub-cache snapshot directory (…/models--org--name/snapshots/<commit>), else None."""
    if not model_path:
        return None
    m = _HUB_SNAPSHOT.search(str(model_path).replace(os.sep, "/"))
    return m.group(1) if m else None


def checkpoint_fingerprint(model_path: str) -> Dict[str, Any]:
    """What identifies the checkpoint's contents, cheaply (see the module docstring).

    Top-level files only, as the engines' default loaders read them. Sizes and mtimes follow symlinks
    (a hub snapshot's files are links into its blob store).
    """
    root = Path(model_path)
    names = sorted(p.name for p in root.iterdir() if p.is_file()) if root.is_dir() else []
    config = root / "config.json"
    weights = []
    for name in names:
        low = name.lower()
        if not (low.endswith(".safetensors") or low.endswith(_OTHER_WEIGHTS)):
            continue
        st = os.stat(root / name)
        entry: Dict[str, Any] = {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if low.endswith(".safetensors"):
            entry["header"] = safetensors_header_hash(root / name)
        weights.append(entry)
    return {
        "config": _sha256_file(config) if config.is_file() else None,
        "layout_files": {n: _sha256_file(root / n) for n in names if _LAYOUT_JSON.match(n)},
        "code": {n: _sha256_file(root / n) for n in names if n.endswith(".py")},
        "weights": weights,
        "hub_revision": hub_revision(model_path),
    }


def identity_fields(
    spec: LaunchSpec, *, device_type: str, snapshot_format: str = SNAPSHOT_FORMAT, snapshot_version: int = SNAPSHOT_VERSION
) -> Dict[str, Any]:
    """The fields the source id is computed from (the launch --dry-run prints them)."""
    if not device_type or not isinstance(device_type, str):
        raise ValueError("device_type must be a name such as 'cpu' or 'cuda'")
    if spec.model_path:
        model: Dict[str, Any] = {"path": str(spec.model_path), "fingerprint": checkpoint_fingerprint(spec.model_path)}
    else:
        model = {"name": spec.model, "revision": spec.revision}
    return {
        "engine": spec.engine,
        "engine_version": spec.engine_version,
        "device_type": device_type,
        "model": model,
        "tp": spec.tp,
        "pp": spec.pp,
        "ep": spec.ep if spec.expert_parallel else 1,
        "dtype": spec.dtype,
        "quantization": spec.quantization,
        "layout_extras": dict(spec.layout_extras),
        "snapshot": {"format": snapshot_format, "version": snapshot_version},
    }


def _lower(obj: Any) -> Any:
    if isinstance(obj, str):
        return obj.lower()
    if isinstance(obj, dict):
        return {str(k).lower(): _lower(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lower(v) for v in obj]
    return obj


def canonical_json(fields: Dict[str, Any]) -> str:
    """Sorted keys, no spaces, ASCII only, every string (keys too) lower-cased."""
    return json.dumps(_lower(fields), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def id_of(fields: Dict[str, Any]) -> str:
    """First 16 hex digits of sha256(canonical_json(fields))."""
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()[:ID_HEX]


def source_id(
    spec: LaunchSpec, *, device_type: str, snapshot_format: str = SNAPSHOT_FORMAT, snapshot_version: int = SNAPSHOT_VERSION
) -> str:
    """The source id of a launch: 16 lower-case hex digits."""
    return id_of(
        identity_fields(spec, device_type=device_type, snapshot_format=snapshot_format, snapshot_version=snapshot_version)
    )
