"""Where a capture is written: node-local /dev/shm first (then uploaded), or straight into the store.

A first start pays for the capture inside the engine's weight loading. Written straight into a store on
Lustre or NFS, that is the store's write speed for tens of GiB per rank; written into /dev/shm it is
only the device→host copy, and the launcher uploads the files to the store in the background once the
engine is ready (over several nodes: once the node's ranks are written; launch/capture.py,
staging/upload.py). So the capture goes through /dev/shm when:

- `MXLAUNCH_CAPTURE_VIA_SHM` is not `off`,
- the store is not on tmpfs itself (a store in /dev/shm gains nothing from a second copy), and
- /dev/shm has room for this node's ranks — the same check staging makes: the filesystem's free space,
  available RAM and the job's memory limit (tmpfs pages count against it), after what a CPU engine
  holds itself (its own copy of the weights).

The capture's size is estimated before the engine starts: the checkpoint's weight files (their sizes
are in the source id's fingerprint) split over the snapshot's ranks, doubled where the command asks for
float32 from a 16-bit checkpoint, plus a margin. `make_plan` decides it (the dry run shows it as
`capture_via` and `capture_via_reason`); with no room the capture goes to the store and the plan says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from mxlaunch import settings
from mxlaunch.fileutil import is_tmpfs, nearest_existing
from mxlaunch.launch.capture_part import capture_part, snapshot_nranks
from mxlaunch.launch.cleanup import shm_user_root
from mxlaunch.staging.capacity import capacity_of, format_bytes

if TYPE_CHECKING:
    from mxlaunch.launch.decide import LaunchPlan

SHM = "shm"
STORE = "store"
MARGIN = 1.05  # the raw tensors against the checkpoint: replicated norms and biases per TP rank, headers
RANK_SLACK = 16 << 20
_WIDE = ("float32", "float")
_NARROW = ("bfloat16", "float16", "half")


@dataclass(frozen=True)
class CaptureRoute:
    via: str  # "shm" | "store"
    reason: str
    bytes: int  # this node's capture, estimated (0: not estimated)


def checkpoint_weight_bytes(identity: dict) -> int:
    """The checkpoint's weight bytes from the source id's fields: *.safetensors files, else the others."""
    weights = (((identity or {}).get("model") or {}).get("fingerprint") or {}).get("weights") or []
    sizes = [(str(w.get("name", "")), int(w.get("size", 0))) for w in weights if isinstance(w, dict)]
    safetensors = [n for name, n in sizes if name.lower().endswith(".safetensors")]
    return sum(safetensors) if safetensors else sum(n for _, n in sizes)


def _widening(spec: Any) -> float:
    """2 when the command asks for float32 and the checkpoint is 16-bit (the engine then holds 4-byte tensors)."""
    if str(getattr(spec, "dtype", "auto")).lower() not in _WIDE or not spec.model_path:
        return 1.0
    try:
        config = json.loads((Path(spec.model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 1.0
    stored = str(config.get("torch_dtype") or config.get("dtype") or "").lower() if isinstance(config, dict) else ""
    return 2.0 if stored in _NARROW else 1.0


def estimate_node_bytes(plan: "LaunchPlan") -> tuple[int, list[int]]:
    """(estimated bytes this node captures, its snapshot ranks)."""
    nranks = snapshot_nranks(plan)
    ranks = capture_part(plan.local_ranks, nranks).ranks
    per_rank = checkpoint_weight_bytes(plan.identity) * _widening(plan.spec) / max(1, nranks)
    return int(per_rank * MARGIN * len(ranks)) + RANK_SLACK * len(ranks), ranks


def decide_capture_route(plan: "LaunchPlan", store_root: Path, shm_root: Optional[Path] = None) -> CaptureRoute:
    """Where this node's capture goes, and why (see the module docstring)."""
    if settings.capture_via_shm() == "off":
        return CaptureRoute(STORE, f"{settings.CAPTURE_VIA_SHM}=off: the capture is written straight into the store", 0)
    root = nearest_existing(store_root)
    if is_tmpfs(root):
        return CaptureRoute(STORE, f"the store ({store_root}) is on tmpfs already: the capture is written straight into it", 0)
    need, ranks = estimate_node_bytes(plan)
    engine_copy = need if plan.device_type == "cpu" else 0  # a CPU engine holds the weights in RAM as well
    shm = shm_root or shm_user_root()
    cap = capacity_of(shm)
    if need + engine_copy > cap.usable:
        held = f" + {format_bytes(engine_copy)} the CPU engine holds itself" if engine_copy else ""
        return CaptureRoute(STORE, f"no room in /dev/shm for this node's capture: snapshot rank(s) {ranks} need about "
                                   f"{format_bytes(need)}{held}, but {cap.binding_limit} leaves {format_bytes(cap.usable)}; "
                                   f"the capture is written straight into the store ({store_root}), at its write speed",
                            need)
    return CaptureRoute(SHM, f"the store ({store_root}) is not on tmpfs: snapshot rank(s) {ranks} (about "
                             f"{format_bytes(need)}) are written into /dev/shm ({format_bytes(cap.usable)} usable) and "
                             "uploaded to the store in the background once the engine is ready", need)
