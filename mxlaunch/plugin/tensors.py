"""Named tensors of a model, grouped by storage, and the errors of the snapshot paths.

**Storage groups.** Names whose tensors are the same view of the same storage (tied weights: one
Parameter under two names, e.g. `lm_head.weight` and `model.embed_tokens.weight`) form one group. A group
is saved once, under its first name; the others are recorded in the file's metadata
(`mxlaunch.aliases`: {"first name": ["alias", ...]}) and are filled by that one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64"), ("float8_e8m0fnu", "F8_E8M0")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}



# ---- errors ----------------------------------------------------------------------------------------


class RestoreError(RuntimeError):
    """Restoring failed. `landed`: whether any destination byte was already written."""

    def __init__(self, message: str, *, landed: bool = False) -> None:
        super().__init__(message)
        self.landed = landed


class SnapshotTimeout(RestoreError):
    """A file of the snapshot did not appear in time."""


class SnapshotCorrupt(RestoreError):
    """A file exists but is not a complete, well-formed safetensors file of the expected size."""


class LayoutMismatch(RestoreError):
    """The snapshot's tensors do not match the target's: unknown, missing, twice, shape or dtype."""


class Reinitialise(RuntimeError):
    """Raised out of the engine's load step when bytes of a P2P pull landed (or post-processing already
    ran on placeholders) and the pull failed: the adapter builds the model again and loads it by the
    engine's default loader. Never serve the partial model."""


class CaptureError(RuntimeError):
    """Writing the snapshot failed (the partial files were removed)."""


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as one flat uint8 tensor (a copy only when t is not contiguous). A one-element tensor may carry
    stride 0 (an expanded scalar, such as a per-tensor scale) and still count as contiguous, and view(uint8)
    refuses that stride (torch 2.13: "stride(-1) must be 1"): its one element is re-strided, not copied."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


# ---- targets: named tensors grouped by storage ---------------------------------------------------------


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of `module`, by every name it has (tied names included)."""
    out: list[tuple[str, torch.Tensor]] = [
        (name, param) for name, param in module.named_parameters(remove_duplicate=False)
    ]
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
        for buf_name, buf in mod._buffers.items():
            if buf is None or buf_name in non_persistent:
                continue
            out.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    # named_modules(remove_duplicate=False) can list one (module, buffer) pair under two paths: fine,
    # both names are aliases of one storage group. Drop exact (name, tensor) repeats only.
    seen: set[str] = set()
    unique = []
    for name, tensor in out:
        if name not in seen:
            seen.add(name)
            unique.append((name, tensor))
    return unique


def _view_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


@dataclass
class Group:
    """Names that share one tensor (same storage, offset, shape, stride, dtype); `name` is the first."""

    names: list[str]
    tensor: torch.Tensor

    @property
    def name(self) -> str:
        return self.names[0]


def group_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[Group]:
    """Group names by identical views, in first-appearance order. Meta tensors have no data: skipped."""
    groups: dict[tuple, Group] = {}
    names: set[str] = set()
    for name, tensor in named:
        if name in names:
            raise ValueError(f"tensor name {name!r} given twice")
        names.add(name)
        t = tensor.detach()
        if t.device.type == "meta":
            continue
        key = _view_key(t) if t.numel() else ("empty", name)  # zero-size tensors share no data
        group = groups.get(key)
        if group is None:
            groups[key] = Group([name], t)
        else:
            group.names.append(name)
    return list(groups.values())
