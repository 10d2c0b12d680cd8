"""The `p2p` strategy in the engine-neutral core: pull a rank's tensors from a live source, then serve.

Target (a worker whose plan says strategy p2p):
    sources = registry.sources(source_id, rank)       # live records, freshest first, same world and layout
    for each source: match names/dtypes/shapes/strides against its manifest, and it must publish a
    checksum of every tensor (refused before any byte moves) → register this worker's memory by
    allocation → one-sided READs → every tensor's checksum checked (transfer/digest.py) → done
    a mismatch or a failure before bytes land → the next source; none left → the caller's fallback;
    a failure after bytes landed, a checksum that differs included → `landed=True`: the caller
    re-initialises the model (never serves it).
Source (any worker whose plan has p2p serving on, after its weights are final):
    checksum every tensor it serves from its own loaded bytes (before registering them: NIXL exposes
    registered memory for remote WRITE too), register them (processed: the model's own memory, zero-copy;
    raw: a host copy made before post-processing), publish a record with the NIXL metadata and the
    manifest (GPU memory: also the address of the socket that hands CUDA IPC handles to this uid's
    same-host peers — the handles themselves never enter a record), heartbeat in a daemon thread,
    unpublish at exit (the launcher also removes its run's records when it stops).

One NIXL agent per worker process: the memory a target registered to pull into is what it serves
afterwards (processed layout), so becoming a source costs no second registration.
"""

from __future__ import annotations

import atexit
import base64
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from mxlaunch import settings
from mxlaunch.coord.peers_record import IPC_HANDOFF
from mxlaunch.fileutil import boot_id
from mxlaunch.plugin.tensors import Group, LayoutMismatch, RestoreError, group_tensors
from mxlaunch.transfer.regions import Region, region_index, regions_for
from mxlaunch.transfer.digest import add_digests, mismatches
from mxlaunch.transfer.tensor_set import byte_view, describe, span_bytes  # noqa: F401 - byte_view: public here too

log = logging.getLogger("mxlaunch.plugin")

ALIGN = 256  # offsets of the raw host copy (keeps every dtype aligned and DMA-friendly)


@dataclass
class RawCopy:
    """A host copy of a rank's raw tensors (before post-processing): what a CPU source serves."""

    buffer: torch.Tensor
    groups: list[Group]
    entries: list[dict]
    digest_seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return int(self.buffer.numel())


def keep_raw(named: Iterable[tuple[str, torch.Tensor]]) -> RawCopy:
    """Copy every storage group's bytes into one host buffer (one registration), recording each one's
    place; the manifest keeps the original dtype, shape and stride so a target matches its own raw model,
    and each group's checksum, taken from the loaded tensor itself (transfer/digest.py)."""
    groups = [g for g in group_tensors(named) if g.tensor.numel()]
    offsets, total = [], 0
    for g in groups:
        offsets.append(total)
        total += -(-span_bytes(g.tensor) // ALIGN) * ALIGN
    buffer = torch.empty(max(total, ALIGN), dtype=torch.uint8)
    entries = describe(groups)
    base = buffer.data_ptr()
    for g, off, entry in zip(groups, offsets, entries):
        n = span_bytes(g.tensor)
        buffer[off:off + n].copy_(byte_view(g.tensor))
        entry.update(addr=base + off, dev=0, device="cpu", region=0)
    started = time.perf_counter()
    add_digests(groups, entries)
    return RawCopy(buffer, groups, entries, time.perf_counter() - started)


# ---- the worker's agent and what it serves -------------------------------------------------------------

_lock = threading.Lock()
_agent: Any = None
_regions: list[Region] = []
_serving: list[Any] = []  # publications, raw copies: alive as long as the worker


def worker_name() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def agent() -> Any:
    """This worker's NIXL agent (started once; its start overlaps nothing else worth measuring)."""
    global _agent
    with _lock:
        if _agent is None:
            from mxlaunch.transfer.nixl import Agent

            _agent = Agent(worker_name())
            atexit.register(close_agent)  # after _unpublish_all (atexit runs the last registered first)
        return _agent


def close_agent() -> None:
    """Destroy this worker's agent before the interpreter's exit tears UCX down under it."""
    global _agent
    with _lock:
        if _agent is not None:
            _agent.close()
            _agent = None
        _regions.clear()


def register_once(regions: Sequence[Region]) -> float:
    """Register regions not registered yet by this worker; returns seconds spent."""
    new = [r for r in regions if not any(o.kind == r.kind and o.dev == r.dev and o.addr <= r.addr and r.end <= o.end
                                         for o in _regions)]
    if not new:
        return 0.0
    took = agent().register(new)
    _regions.extend(new)
    return took


# ---- target --------------------------------------------------------------------------------------------


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
                reg_took = register_once(regions)
                phases["register"] = reg_took
                nixl = agent().pull(base64.b64decode(rec.agent_metadata), over_nixl, timeout_s=timeout_s, on_batch=on_batch)
                phases["connect"] = phases.get("connect", 0.0) + nixl.connect_seconds
                phases["transfer"] = phases.get("transfer", 0.0) + nixl.transfer_seconds
                registrations = agent().registrations
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

    handoff = rec.extra.get(HANDOFF)
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
    a = agent()
    agent_s = time.perf_counter() - started
    entries = [e for e in registry.sources(source_id, rank) if e.record.world == world and e.record.layout == layout]
    if not entries:
        return {"agent_seconds": agent_s, "warmed": 0}
    rec = entries[0].record
    if rec.extra.get(HANDOFF) and settings.p2p_cuda_ipc() and rec.boot_id and rec.boot_id == boot_id():
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
    register_once([scratch])
    spans = [(int(e["addr"]), int(e["bytes"]), int(e["dev"]), str(e.get("device", "cpu"))) for e in first.values()]
    opened = a.warm(base64.b64decode(rec.agent_metadata), spans, scratch)
    _warmed[(source_id, rank)] = rec.worker
    return {"agent_seconds": round(agent_s, 4), "warmed": opened, "seconds": round(time.perf_counter() - started, 4),
            "source": rec.worker}


_scratch: Any = None


# ---- source --------------------------------------------------------------------------------------------


def serve(named: Sequence[tuple[str, torch.Tensor]] | RawCopy, *, registry: Any, source_id: str, rank: int,
          world: int, layout: str, run_id: str, ttl_s: float = 15.0) -> Any:
    """Register what this worker serves and publish it; returns the publication (kept alive here)."""
    from mxlaunch.coord.peers import local_record

    if isinstance(named, RawCopy):
        regions = [Region(named.buffer.data_ptr(), named.bytes, 0, "cpu")]
        entries = named.entries
        digest_took = named.digest_seconds
        base = named.buffer.data_ptr()
        served = [named.buffer[int(e["addr"]) - base:int(e["addr"]) - base + int(e["bytes"])] for e in entries]
        _serving.append(named)
    else:
        groups = [g for g in group_tensors(named) if g.tensor.numel()]
        regions = regions_for([g.tensor for g in groups])
        entries = describe(groups, region_index(regions))
        started = time.perf_counter()
        add_digests(groups, entries)  # before registering: from here on a peer could write into them
        digest_took = time.perf_counter() - started
        served = [byte_view(g.tensor) for g in groups]
    reg_took = register_once(regions)
    a = agent()
    device = "cuda" if any(r.kind == "cuda" for r in regions) else "cpu"
    extra = {"register_seconds": round(reg_took, 4), "digest_seconds": round(digest_took, 4), "regions": len(regions),
             "bytes": sum(int(e["bytes"]) for e in entries)}
    server = _handoff_server(regions, entries, extra, a.name) if device == "cuda" and settings.p2p_cuda_ipc() else None
    record = local_record(source_id, rank, world, layout=layout, worker=a.name, run_id=run_id, device=device,
                          agent_metadata=a.metadata(), tensors=entries, extra=extra)
    try:
        publication = registry.publish(record, ttl_s=ttl_s)
    except BaseException:
        if server is not None:
            server.close()
        raise
    if server is not None:  # hands out handles while the record is published, closed with it (_unpublish_all)
        server.alive = lambda: not publication.lost
        _handoffs.append(server.start())
    publication.verifier = self_check(entries, served, a.name)
    publication.keep_alive()
    _serving.append(publication)
    atexit.register(_unpublish_all)
    return publication


HANDOFF = IPC_HANDOFF  # the record's {"socket": address, "allocations": n}; the handles are never in it
_handoffs: list[Any] = []  # this worker's handoff servers (transfer/ipc_handoff.py)


def _handoff_server(regions: Sequence[Region], entries: Sequence[dict], extra: dict, worker: str) -> Any:
    """Export the GPU regions' CUDA IPC handles and bind the socket that hands them to this uid's peers; the
    record gets the socket's address (`extra[HANDOFF]`), or `cuda_ipc_why` when there is nothing to hand out."""
    from mxlaunch.transfer import cuda_ipc, ipc_handoff

    allocations, why = cuda_ipc.export_regions(regions)
    if not allocations:  # said in the record: the target's "passed over" and the source's own line name it
        extra["cuda_ipc_why"] = why[:300]
        return None
    try:
        server = ipc_handoff.HandoffServer({"worker": worker, "allocations": allocations})
    except OSError as exc:
        extra["cuda_ipc_why"] = f"no socket to hand the handles over ({exc})"[:300]
        return None
    extra[HANDOFF] = {"socket": server.address, "allocations": len(allocations)}
    host = [e["name"] for e in entries if e.get("device") != "cuda"]
    if host:  # these few stay on NIXL; named so a reader sees what they are
        extra["cuda_ipc_host_tensors"] = {"count": len(host), "names": host[:5]}
    return server


def self_check(entries: Sequence[dict], served: Sequence[torch.Tensor], name: str) -> Callable[[], dict]:
    """`mxlaunch peers --verify`'s answer: recompute every served span's checksum (what a target would READ
    now) against the one published; a difference is logged as an error (the caller stops offering it)."""
    from mxlaunch.transfer.digest import digest

    def verify() -> dict:
        started = time.perf_counter()
        bad = [e["name"] for e, view in zip(entries, served) if digest(view, e["digest"].split(":", 1)[0]) != e["digest"]]
        took = time.perf_counter() - started
        if bad:
            log.error("mxlaunch: P2P source %s: %d tensor(s) no longer match the checksums it published (%s): its "
                      "registered memory was written by someone; it stops serving as a source", name, len(bad),
                      ", ".join(bad[:3]))
        return {"ok": not bad, "bad": bad[:20], "tensors": len(entries), "seconds": round(took, 4)}

    return verify


def _unpublish_all() -> None:
    while _handoffs:  # no handle handed out once the source is going
        _handoffs.pop().close()
    for item in _serving:
        if hasattr(item, "unpublish"):
            try:
                item.unpublish()
            except Exception:  # noqa: BLE001 - exiting anyway; the launcher and the reaper remove it too
                pass
