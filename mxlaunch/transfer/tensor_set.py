"""The tensors a P2P source serves, their manifest, and the exact match a target needs before pulling.

A source serves one of two layouts (coord/peers.py LAYOUTS):
    processed  the tensors the model holds after the engine's post-processing — parameters, buffers and
               tensors post-processing attached as plain attributes (e.g. a packed qkv). On a GPU this is
               zero-copy: the target builds the same model, post-processes placeholder values to get the
               same layout, then pulls every tensor.
    raw        the tensors as the engine's weight loading left them, before post-processing (the layout of
               mxlaunch's raw snapshot). The CPU seam: vLLM's CPU build repacks linear weights and leaves
               the parameters empty, so a CPU source keeps a host copy of the raw tensors and the target
               post-processes after pulling, exactly like a staged restore.

A manifest entry describes one storage group (plugin/tensors.py): its names, dtype, shape, stride, the
byte span a copy moves, and where it lives in the source (address, device, registered region). A target
refuses a source before any byte moves unless every group matches name by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from mxlaunch.plugin.tensors import _CODES, _DTYPES, Group, LayoutMismatch, group_tensors, module_tensors

ENTRY_KEYS = ("name", "dtype", "shape", "bytes", "addr", "dev")


def attached_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors set as plain attributes of a module (not parameters or buffers): post-processing of
    quantized and packed layers attaches such tensors, and they are part of what the model serves."""
    out = []
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not attr.startswith("__"):
                out.append((f"{mod_name}.{attr}" if mod_name else attr, value))
    return out


def processed_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Everything a post-processed model holds: parameters, persistent buffers, attached tensors."""
    named = module_tensors(model)
    seen = {n for n, _ in named}
    return named + [(n, t) for n, t in attached_tensors(model) if n not in seen]


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to its last (its whole extent for a strided view)."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        return t.numel() * t.element_size()
    if any(s < 0 for s in t.stride()):
        raise LayoutMismatch(f"a tensor with negative strides {t.stride()} cannot be transferred")
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes a transfer moves for `t` (its span), as a uint8 tensor on the same storage."""
    n = span_bytes(t)
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


def device_index(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else 0


def describe(groups: Sequence[Group], region_of: Any = None) -> list[dict]:
    """The manifest of `groups`: one entry per storage group (aliases listed), in order.
    `region_of(tensor) -> int` names the registered region holding it (for the record; optional)."""
    entries = []
    for g in groups:
        t = g.tensor
        entry = {"name": g.name, "dtype": _DTYPES.get(t.dtype, str(t.dtype)), "shape": list(t.shape),
                 "stride": list(t.stride()), "bytes": span_bytes(t), "addr": t.data_ptr(),
                 "dev": device_index(t), "device": t.device.type}
        if len(g.names) > 1:
            entry["aliases"] = g.names[1:]
        if region_of is not None:
            entry["region"] = region_of(t)
        entries.append(entry)
    return entries


@dataclass(frozen=True)
class Pair:
    """One copy: `bytes` from the source's `remote_addr` into the target's `local_addr`."""

    name: str
    local_addr: int
    remote_addr: int
    bytes: int
    local_dev: int
    remote_dev: int
    local_kind: str = "cpu"  # "cpu" | "cuda"
    remote_kind: str = "cpu"


def match(targets: Iterable[tuple[str, torch.Tensor]], manifest: Sequence[dict]) -> list[Pair]:
    """The copies that fill every target group exactly once from the source's manifest. Raises
    LayoutMismatch (landed=False: nothing moved yet) on any difference: a name either side lacks, a
    dtype, shape or stride, a tie the other side does not have."""
    groups = group_tensors(targets)
    by_name = {n: g for g in groups for n in g.names}
    remote: dict[str, dict] = {}
    for e in manifest:
        remote[e["name"]] = e
    unknown = [n for n in remote if n not in by_name]
    if unknown:
        raise LayoutMismatch(f"the source serves {len(unknown)} tensor(s) this model lacks: {_few(unknown)}")
    pairs: list[Pair] = []
    filled: set[int] = set()
    for name, e in remote.items():
        g = by_name[name]
        t = g.tensor
        if id(g) in filled:
            raise LayoutMismatch(f"tensor {name} ({g.name}) is served twice by the source")
        filled.add(id(g))
        dtype = _CODES.get(e["dtype"])
        if dtype != t.dtype or list(t.shape) != list(e["shape"]):
            raise LayoutMismatch(f"tensor {name}: the source has {e['shape']} {e['dtype']}, this model "
                                 f"{list(t.shape)} {_DTYPES.get(t.dtype, t.dtype)}")
        if t.numel() and list(e.get("stride", t.stride())) != list(t.stride()):
            raise LayoutMismatch(f"tensor {name}: the source's stride {e.get('stride')} differs from this "
                                 f"model's {list(t.stride())} (another post-processing)")
        if span_bytes(t) != int(e["bytes"]):
            raise LayoutMismatch(f"tensor {name}: {e['bytes']} bytes at the source, {span_bytes(t)} here")
        theirs = sorted([e["name"], *e.get("aliases", [])])
        if sorted(g.names) != theirs:
            raise LayoutMismatch(f"tensor {name}: tied to {theirs} at the source, to {sorted(g.names)} here")
        if t.numel():
            pairs.append(Pair(name, t.data_ptr(), int(e["addr"]), span_bytes(t), device_index(t), int(e["dev"]),
                              t.device.type, str(e.get("device", "cpu"))))
    # a zero-size tensor holds no byte to pull, and sources do not serve one (plugin/p2p_source.py): vLLM's attention
    # layers keep an empty `kv_cache` placeholder attached until the KV cache is allocated (seen on the H200)
    missing = [g.name for g in groups if id(g) not in filled and g.tensor.numel()]
    if missing:
        raise LayoutMismatch(f"the source does not serve {len(missing)} tensor(s) of this model: {_few(missing)}")
    return _without_overlaps(pairs)


def _without_overlaps(pairs: list[Pair]) -> list[Pair]:
    """Views of one storage (a packed tensor and its parts) may overlap: one copy per byte. Overlapping
    spans must sit at the same relative place on both sides, else the layouts differ."""
    out: list[Pair] = []
    for p in sorted(pairs, key=lambda p: (p.local_kind, p.local_dev, p.local_addr, -p.bytes)):
        last = out[-1] if out else None
        same_device = last is not None and (p.local_kind, p.local_dev) == (last.local_kind, last.local_dev)
        if last and same_device and p.local_addr < last.local_addr + last.bytes:
            if p.local_addr - last.local_addr != p.remote_addr - last.remote_addr or p.remote_dev != last.remote_dev:
                raise LayoutMismatch(f"tensors {last.name} and {p.name} overlap here but not at the source")
            end = max(last.local_addr + last.bytes, p.local_addr + p.bytes)
            out[-1] = Pair(last.name, last.local_addr, last.remote_addr, end - last.local_addr,
                           last.local_dev, last.remote_dev, last.local_kind, last.remote_kind)
        else:
            out.append(p)
    return out


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", … ({len(names) - n} more)" if len(names) > n else "")
