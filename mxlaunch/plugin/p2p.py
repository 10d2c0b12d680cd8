"""The `p2p` strategy in the engine-neutral core: pull a rank's tensors from a live source, then serve.

Target (a worker whose plan says strategy p2p):
    sources = registry.sources(source_id, rank)       # live records, freshest first, same world and layout
    for each source: match names/dtypes/shapes/strides against its manifest, and it must publish a
    checksum of every tensor (refused before any byte moves) → register this worker's memory by
    allocation → one-sided READs → every tensor's checksum checked (transfer/digest.py) → done
    a mismatch or a failure before bytes land → the next source; none left → the caller's fallback;
    a failure after bytes landed, a checksum that differs included → `landed=True`: the caller
    re-initialises the model (never serves it).
The source side (checksum, register, publish) is plugin/p2p_source.py; the agent both share is
plugin/p2p_agent.py.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mxlaunch import settings
from mxlaunch.coord.peers_record import IPC_HANDOFF
from mxlaunch.fileutil import boot_id
from mxlaunch.plugin import p2p_agent
from mxlaunch.plugin.tensors import LayoutMismatch, RestoreError
from mxlaunch.transfer.regions import Region, regions_for
from mxlaunch.transfer.digest import mismatches


@dataclass
class PullResult:
    bytes: int
    tensors: int
    seconds: float
    source: str  # worker name of the source
    host: str
    register_seconds: float
    transfer_seconds: float
    registrations: int
    skipped: list[str] = field(default_factory=list)  # why earlier sources were passed over
    phases: dict = field(default_factory=dict)  # seconds: lookup, match, regions, register, connect, transfer, verify
    warmed: bool = False  # the source's memory was opened while the engine built the model (prepare_pull)
    transport: str = "NIXL"  # or "CUDA IPC" (a source on this host: transfer/cuda_ipc.py)


def pull(named: Sequence[tuple[str, torch.Tensor]], *, registry: Any, source_id: str, rank: int, world: int,
         layout: str, timeout_s: float = 300.0, on_batch: Callable[[int], None] | None = None) -> PullResult:
    """Fill `named` from the freshest live source that matches exactly. Raises RestoreError: landed=False
    when nothing was written (the caller may fall back), True when the model is partial."""
    from mxlaunch.transfer.nixl import NixlUnavailable, TransferError
    from mxlaunch.transfer.tensor_set import match

    started = time.perf_counter()
    skipped: list[str] = []
    entries = registry.sources(source_id, rank)
    skipped += list(getattr(registry, "refusals", []))  # records others could have written: never used
    if not entries:
        refused = f" ({'; '.join(skipped)})" if skipped else ""
        raise RestoreError(f"no live P2P source of {source_id} rank {rank} in {registry.url}{refused}", landed=False)
    warmed = _warmed.get((source_id, rank))
    entries.sort(key=lambda e: e.record.worker != warmed)  # the source opened during the build goes first
    phases = {"lookup": time.perf_counter() - started}
    for entry in entries:
        rec = entry.record
        who = f"{rec.worker} on {rec.host}"
        if rec.world != world or rec.layout != layout:
            skipped.append(f"{who}: serves layout {rec.layout} of {rec.world} ranks, this worker needs {layout} of {world}")
            continue
        unproven = [e["name"] for e in rec.tensors if not isinstance(e.get("digest"), str)]
        if unproven:
            skipped.append(f"{who}: publishes no checksum for {len(unproven)} tensor(s) (an older mxlaunch?), so "
                           "what it serves cannot be checked")
            continue
        t0 = time.perf_counter()
        try:
            pairs = match(named, rec.tensors)
        except LayoutMismatch as exc:
            skipped.append(f"{who}: {exc}")
            continue
        phases["match"] = time.perf_counter() - t0
        ipc = _ipc_pull(rec, pairs, skipped)
        over_nixl = pairs if ipc is None else ipc[1]  # with IPC: only what is not GPU memory on both sides
        stats = ipc[0] if ipc is not None else None
        transport, reg_took, registrations = "CUDA IPC", 0.0, 0
        if ipc is not None:
            phases["connect"], phases["transfer"] = ipc[0].open_seconds, ipc[0].transfer_seconds
        if ipc is None or over_nixl:
            transport = "CUDA IPC + NIXL" if ipc is not None else "NIXL"
            try:
                t0 = time.perf_counter()
                regions = regions_for([t for _, t in named])
                phases["regions"] = time.perf_counter() - t0
                reg_took = p2p_agent.register_once(regions)
                phases["register"] = reg_took
                nixl = p2p_agent.agent().pull(base64.b64decode(rec.agent_metadata), over_nixl, timeout_s=timeout_s, on_batch=on_batch)
                phases["connect"] = phases.get("connect", 0.0) + nixl.connect_seconds
                phases["transfer"] = phases.get("transfer", 0.0) + nixl.transfer_seconds
                registrations = p2p_agent.agent().registrations
            except NixlUnavailable as exc:
                raise RestoreError(str(exc), landed=ipc is not None) from exc
            except TransferError as exc:
                if exc.landed or ipc is not None:
                    raise RestoreError(f"the transfer from {who} failed after bytes landed: {exc}", landed=True) from exc
                skipped.append(f"{who}: {exc}")
                continue
            stats = nixl if stats is None else _Moved(stats.bytes + nixl.bytes, stats.transfer_seconds + nixl.transfer_seconds)
        t0 = time.perf_counter()
        bad = mismatches(named, rec.tensors)
        phases["verify"] = time.perf_counter() - t0
        if bad:
            raise RestoreError(f"{len(bad)} tensor(s) pulled from {who} differ from the checksums it published "
                               f"({', '.join(bad[:3])}{', …' if len(bad) > 3 else ''}): its memory changed after it "
                               "loaded, or the transfer corrupted them — not serving them", landed=True)
        return PullResult(stats.bytes, len(pairs), time.perf_counter() - started, rec.worker, rec.host, reg_took,
                          stats.transfer_seconds, registrations, skipped,
                          {k: round(v, 4) for k, v in phases.items()}, rec.worker == warmed, transport)
    raise RestoreError(f"no P2P source of {source_id} rank {rank} could serve this worker: " + "; ".join(skipped),
                       landed=False)


@dataclass
class _Moved:
    """What a pull moved, whichever transports carried it."""

    bytes: int
    transfer_seconds: float


def _ipc_pull(rec: Any, pairs: Sequence[Any], skipped: list[str]) -> Any:
    """The GPU-to-GPU pairs copied through CUDA IPC when the source is on this host and exported handles:
    (stats, the pairs left for NIXL), or None to use NIXL for all (why is added to `skipped`).
    RestoreError(landed=True) if a copy failed after it began."""
    from mxlaunch.transfer import cuda_ipc, ipc_handoff

    handoff = rec.extra.get(IPC_HANDOFF)
    gpu, rest = cuda_ipc.split(pairs)
    if not settings.p2p_cuda_ipc() or not rec.boot_id or rec.boot_id != boot_id() or not gpu:
        return None  # off, another host, or host memory: NIXL is the way, nothing to say
    if not handoff:
        why = rec.extra.get("cuda_ipc_why") or (
            "it wrote them into its record (an older mxlaunch), where anyone who reads it could open them: not used"
            if rec.extra.get("cuda_ipc") else "it names no reason (an older mxlaunch, or MXLAUNCH_CUDA_IPC=0 there)")
        skipped.append(f"{rec.worker}: exported no CUDA IPC handles: {why} (pulled over NIXL instead)")
        return None
    try:  # the handles come from the source itself, over its socket, to this uid alone (transfer/ipc_handoff.py)
        allocations = ipc_handoff.fetch(handoff["socket"], pid=rec.pid, worker=rec.worker)
    except ipc_handoff.HandoffError as exc:
        skipped.append(f"{rec.worker}: CUDA IPC: {exc} (pulled over NIXL instead)")
        return None
    try:
        return cuda_ipc.pull(allocations, gpu, torch.cuda.current_stream().cuda_stream), rest
    except cuda_ipc.CudaIpcError as exc:
        if exc.landed:
            raise RestoreError(f"the CUDA IPC copy from {rec.worker} on {rec.host} failed after bytes landed: {exc}",
                               landed=True) from exc
        skipped.append(f"{rec.worker}: CUDA IPC: {exc} (pulled over NIXL instead)")
        return None


_warmed: dict[tuple[str, int], str] = {}  # (source id, rank) → the worker prepare_pull opened
WARM_BYTES = 4096


def prepare_pull(*, registry: Any, source_id: str, rank: int, world: int, layout: str, device: str,
                 device_index: int = 0) -> dict:
    """While the engine builds the model: start the agent, pick the freshest compatible source, load its
    metadata and open each of its registered regions with one small READ into a scratch buffer (the
    first access to a peer GPU's allocation maps it, and that costs more than its bytes). The pull after
    post-processing then is the transfer alone. Best effort: any failure leaves the pull to do it all."""
    started = time.perf_counter()
    a = p2p_agent.agent()
    agent_s = time.perf_counter() - started
    entries = [e for e in registry.sources(source_id, rank) if e.record.world == world and e.record.layout == layout]
    if not entries:
        return {"agent_seconds": agent_s, "warmed": 0}
    rec = entries[0].record
    if rec.extra.get(IPC_HANDOFF) and settings.p2p_cuda_ipc() and rec.boot_id and rec.boot_id == boot_id():
        return {"agent_seconds": round(agent_s, 4), "warmed": 0, "source": rec.worker, "transport": "CUDA IPC"}
    first: dict[int, dict] = {}
    for e in rec.tensors:
        r = int(e.get("region", -1))
        if int(e["bytes"]) > 0 and (r not in first or int(e["addr"]) < int(first[r]["addr"])):
            first[r] = e
    global _scratch
    if _scratch is None:
        _scratch = torch.empty(WARM_BYTES, dtype=torch.uint8, device=f"{device}:{device_index}" if device == "cuda" else "cpu")
    scratch = Region(_scratch.data_ptr(), WARM_BYTES, device_index if device == "cuda" else 0, device)
    p2p_agent.register_once([scratch])
    spans = [(int(e["addr"]), int(e["bytes"]), int(e["dev"]), str(e.get("device", "cpu"))) for e in first.values()]
    opened = a.warm(base64.b64decode(rec.agent_metadata), spans, scratch)
    _warmed[(source_id, rank)] = rec.worker
    return {"agent_seconds": round(agent_s, 4), "warmed": opened, "seconds": round(time.perf_counter() - started, 4),
            "source": rec.worker}


_scratch: Any = None
