"""One NIXL agent per worker: register memory by allocation, hand out metadata, pull with one-sided READs.

A source registers its regions and publishes `metadata()` (the agent's UCX address and memory keys) in
the peer registry; it does nothing per transfer — UCX serves READs from the registered memory. A target
registers its own regions, adds the source's metadata, and READs every (local, remote) span in batches,
polling each batch to completion with a deadline. Between two processes of one host UCX picks CUDA IPC
for GPU memory and shared memory for host memory; across hosts, the network transports it finds.

Errors are `TransferError` with `landed`: whether any byte of the target may already have been written
(the first batch was posted) — the caller's fallback rules (plugin/tensors.RestoreError) depend on it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Iterable, Sequence

from mxlaunch.plugin.tensors import RestoreError
from mxlaunch.transfer.regions import Region
from mxlaunch.transfer.tensor_set import Pair

log = logging.getLogger("mxlaunch.transfer")

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the generic package, then the CUDA-specific wheels
_MEM = {"cpu": "DRAM", "cuda": "VRAM"}
BATCH_BYTES = 4 << 30  # one READ request moves at most this much (the deadline is checked between polls)
BATCH_DESCS = 8192


class NixlUnavailable(RuntimeError):
    """NIXL cannot be imported or started in this process."""


class TransferError(RestoreError):
    """A pull failed; `landed` says whether target bytes may have been written."""


def import_nixl() -> ModuleType:
    """The NIXL Python API, whichever wheel provides it; its INFO chatter is lowered to warnings."""
    errors = []
    for name in _MODULES:
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except Exception as exc:  # noqa: BLE001 - ImportError, or a wheel built for another CUDA
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise NixlUnavailable("NIXL is not installed in the engine's Python — pip install 'mxlaunch[p2p]' there "
                          f"(nixl-cu12 or nixl-cu13) ({'; '.join(errors)[:300]})")


@dataclass
class PullStats:
    bytes: int = 0
    descriptors: int = 0
    batches: int = 0
    connect_seconds: float = 0.0
    transfer_seconds: float = 0.0
    backends: list[str] = field(default_factory=list)


class Agent:
    """A named NIXL agent with the UCX backend; `close()` deregisters everything it registered."""

    def __init__(self, name: str) -> None:
        api = import_nixl()
        started = time.perf_counter()
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        except Exception as exc:  # noqa: BLE001
            raise NixlUnavailable(f"NIXL could not start agent {name}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend here (its plugin did not load)")
        self.name = name
        self.start_seconds = time.perf_counter() - started
        self._registered: list = []
        self._remotes: dict[bytes, object] = {}
        self.registrations = 0
        self.register_seconds = 0.0

    def register(self, regions: Sequence[Region]) -> float:
        """Register `regions` (one NIXL call per memory kind); returns the seconds it took."""
        started = time.perf_counter()
        for kind in sorted({r.kind for r in regions}):
            chosen = [(r.addr, r.bytes, r.dev, "") for r in regions if r.kind == kind and r.bytes > 0]
            if chosen:
                self._registered.append(self._agent.register_memory(chosen, _MEM[kind]))
                self.registrations += len(chosen)
        took = time.perf_counter() - started
        self.register_seconds += took
        return took

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def pull(self, remote_metadata: bytes, pairs: Sequence[Pair], *, timeout_s: float = 300.0,
             on_batch: Callable[[int], None] | None = None, chunk_bytes: int = 0, inflight: int = 1,
             op: str = "READ") -> PullStats:
        """READ every pair from the peer whose metadata is given: batches of descriptors, up to `inflight`
        of them posted at once; `chunk_bytes` > 0 splits big spans (more copies in parallel).
        `on_batch(i)` runs before batch i is posted (tests use it to kill a source mid-transfer).
        op="WRITE" moves the same spans the other way (local → peer; the push direction)."""
        stats = PullStats()
        started = time.perf_counter()
        remote = self.connect(remote_metadata)
        stats.connect_seconds = time.perf_counter() - started
        deadline = time.monotonic() + timeout_s
        work = split(pairs, chunk_bytes) if chunk_bytes > 0 else list(pairs)
        total = sum(p.bytes for p in work)
        limit = BATCH_BYTES if inflight <= 1 else max(1, -(-total // inflight))
        pending: deque = deque()
        landed = False
        t0 = time.perf_counter()
        try:
            for i, batch in enumerate(_batches(work, limit)):
                if on_batch is not None:
                    on_batch(i)
                pending.append((self._post(remote, batch, landed, op), batch))
                landed = True
                while len(pending) >= max(1, inflight):
                    self._finish(remote, *pending.popleft(), deadline, stats)
            while pending:
                self._finish(remote, *pending.popleft(), deadline, stats)
        except TransferError:
            for handle, _ in pending:
                _release(self._agent, handle)
            self.disconnect(remote_metadata)
            raise
        stats.transfer_seconds = time.perf_counter() - t0
        return stats

    def _post(self, remote: object, batch: list[Pair], landed: bool, op: str = "READ") -> object:
        """Prepare and post one READ; a failure here means this batch wrote nothing."""
        local = self._agent.get_xfer_descs([(p.local_addr, p.bytes, p.local_dev) for p in batch], _MEM[batch[0].local_kind])
        far = self._agent.get_xfer_descs([(p.remote_addr, p.bytes, p.remote_dev) for p in batch], _MEM[batch[0].remote_kind])
        try:
            handle = self._agent.initialize_xfer(op, local, far, remote)
        except Exception as exc:  # noqa: BLE001 - e.g. the source's memory is no longer registered
            raise TransferError(f"NIXL refused the transfer: {exc}", landed=landed) from exc
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - e.g. NIXL_ERR_REMOTE_DISCONNECT: the source is gone
            _release(self._agent, handle)
            raise TransferError(f"NIXL could not post the READ from {_text(remote)}: {exc}", landed=landed) from exc
        if state == "ERR":
            _release(self._agent, handle)
            raise TransferError(f"NIXL could not post the READ from {_text(remote)}", landed=True)
        return handle

    def _finish(self, remote: object, handle: object, batch: list[Pair], deadline: float, stats: PullStats) -> None:
        try:
            try:
                state = _wait(self._agent, handle, "PROC", deadline)
            except Exception as exc:  # noqa: BLE001
                raise TransferError(f"the READ from {_text(remote)} failed: {exc}", landed=True) from exc
            if state != "DONE":
                raise TransferError(f"the READ from {_text(remote)} ended in state {state}", landed=True)
            if not stats.backends:
                stats.backends = [_backend(self._agent, handle)]
        finally:
            _release(self._agent, handle)
        stats.bytes += sum(p.bytes for p in batch)
        stats.descriptors += len(batch)
        stats.batches += 1

    def connect(self, remote_metadata: bytes) -> object:
        """Load a peer's metadata once (kept: a warm-up and the pull share the connection)."""
        remote = self._remotes.get(remote_metadata)
        if remote is None:
            try:
                remote = self._agent.add_remote_agent(remote_metadata)
            except Exception as exc:  # noqa: BLE001
                raise TransferError(f"NIXL could not load the source's metadata: {exc}", landed=False) from exc
            self._remotes[remote_metadata] = remote
        return remote

    def disconnect(self, remote_metadata: bytes) -> None:
        remote = self._remotes.pop(remote_metadata, None)
        if remote is not None:
            try:
                self._agent.remove_remote_agent(remote)
            except Exception:  # noqa: BLE001
                pass

    def warm(self, remote_metadata: bytes, spans: Sequence[tuple[int, int, int, str]], scratch: Region,
             timeout_s: float = 30.0) -> int:
        """Open the peer's memory before the pull: one small READ from each (addr, bytes, dev, kind) span
        into a scratch region of this agent. Between two GPUs the first READ from an allocation maps it
        (CUDA IPC), which costs more than moving its bytes; done while the engine builds the model, it
        leaves the pull after post-processing to the transfer alone. Returns how many spans were read."""
        pairs = [Pair("warm", scratch.addr, addr, min(n, scratch.bytes), scratch.dev, dev, scratch.kind, kind)
                 for addr, n, dev, kind in spans if n > 0]
        self.pull(remote_metadata, pairs, timeout_s=timeout_s)
        return len(pairs)

    def close(self) -> None:
        for metadata in list(self._remotes):
            self.disconnect(metadata)
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:  # noqa: BLE001
                log.warning("mxlaunch: NIXL could not deregister memory: %s", exc)
        self._registered.clear()


def split(pairs: Iterable[Pair], chunk: int) -> list[Pair]:
    """Spans longer than `chunk` bytes cut into pieces (each piece its own copy)."""
    out = []
    for p in pairs:
        for off in range(0, p.bytes, chunk):
            out.append(Pair(p.name, p.local_addr + off, p.remote_addr + off, min(chunk, p.bytes - off), p.local_dev,
                            p.remote_dev, p.local_kind, p.remote_kind))
    return out


def _batches(pairs: Iterable[Pair], limit: int | None = None) -> Iterable[list[Pair]]:
    """Pairs grouped by memory kinds, each batch at most `limit` (BATCH_BYTES) bytes and BATCH_DESCS."""
    limit = limit or BATCH_BYTES
    by_kind: dict[tuple[str, str], list[Pair]] = {}
    for p in pairs:
        by_kind.setdefault((p.local_kind, p.remote_kind), []).append(p)
    for group in by_kind.values():
        batch: list[Pair] = []
        size = 0
        for p in group:
            if batch and (size + p.bytes > limit or len(batch) >= BATCH_DESCS):
                yield batch
                batch, size = [], 0
            batch.append(p)
            size += p.bytes
        if batch:
            yield batch


def _wait(agent, handle, state: str, deadline: float) -> str:
    spins = 0
    while state == "PROC":
        if time.monotonic() > deadline:
            return "TIMEOUT"
        spins += 1
        if spins > 1000:
            time.sleep(0.0005)
        state = agent.check_xfer_state(handle)
    return state


def _release(agent, handle) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # noqa: BLE001 - a handle still in flight after a timeout cannot be released
        pass


def _backend(agent, handle) -> str:
    try:
        return str(agent.query_xfer_backend(handle))
    except Exception:  # noqa: BLE001
        return "UCX"


def _text(name: object) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)
