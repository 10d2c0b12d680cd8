"""The `p2p` strategy's source side: offer this worker's loaded tensors to peers (the target side, which pulls
them, is plugin/p2p.py; a worker may be one, the other, or a target first and a source after).

Source (any worker whose plan has p2p serving on, after its weights are final):
    checksum every tensor it serves from its own loaded bytes (before registering them: NIXL exposes
    registered memory for remote WRITE too), register them (processed: the model's own memory, zero-copy;
    raw: a host copy made before post-processing), publish a record with the NIXL metadata and the
    manifest (GPU memory: also the address of the socket that hands CUDA IPC handles to this uid's
    same-host peers — the handles themselves never enter a record), heartbeat in a daemon thread,
    unpublish at exit (the launcher also removes its run's records when it stops).
Its own module: a source runs for the worker's whole life (publication, heartbeat, handoff sockets) while a
pull is one call at load time; they share only the agent (plugin/p2p_agent.py).
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from mxlaunch import settings
from mxlaunch.coord.peers_record import IPC_HANDOFF
from mxlaunch.plugin import p2p_agent
from mxlaunch.plugin.tensors import Group, group_tensors
from mxlaunch.transfer.digest import add_digests
from mxlaunch.transfer.regions import Region, region_index, regions_for
from mxlaunch.transfer.tensor_set import byte_view, describe, span_bytes

log = logging.getLogger("mxlaunch.plugin")

ALIGN = 256  # offsets of the raw host copy (keeps every dtype aligned and DMA-friendly)

_serving: list[Any] = []  # publications, raw copies: alive as long as the worker


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
    reg_took = p2p_agent.register_once(regions)
    a = p2p_agent.agent()
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
    from mxlaunch.transfer.digest import digests

    def verify() -> dict:
        started = time.perf_counter()
        now = digests(list(served), [e["digest"].split(":", 1)[0] for e in entries])
        bad = [e["name"] for e, have in zip(entries, now) if have != e["digest"]]
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
