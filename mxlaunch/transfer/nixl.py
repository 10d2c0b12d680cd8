"""One NIXL agent per worker: register memory by allocation, hand out metadata, pull with one-sided READs.

A source registers its regions and publishes `metadata()` (the agent's UCX address and memory keys) in
the peer registry; it does nothing per transfer — UCX serves READs from the registered memory. A target
registers its own regions, adds the source's metadata, and READs every (local, remote) span in batches,
polling each batch to completion with a deadline. Between two processes of one host UCX picks CUDA IPC
for GPU memory and shared memory for host memory; across hosts, the network transports it finds.

Errors are `TransferError` with `landed`: whether any byte of the target may already have been written
(the first batch was posted) — the caller's fallback rules (plugin/tensors.RestoreError) depend on it.

Knobs (settings.py; docs/p2p.md): MXLAUNCH_NIXL_UCX_PARAMS passes init parameters to the UCX backend
(e.g. num_threads=4,split_batch_size=1: NIXL splits one request over 4 threads, each with its own UCX
worker and so its own CUDA stream), MXLAUNCH_NIXL_PROGRESS_THREAD=0 starts the agent without its
progress thread, MXLAUNCH_NIXL_PULL shapes the pull (prepped descriptor lists, chunking, requests: transfer/nixl_batches.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Sequence

from mxlaunch import settings
from mxlaunch.errors import MxlaunchError
from mxlaunch.plugin.tensors import RestoreError
from mxlaunch.transfer import nixl_batches
from mxlaunch.transfer.nixl_batches import PullConfig
from mxlaunch.transfer.regions import Region
from mxlaunch.transfer.tensor_set import Pair

log = logging.getLogger("mxlaunch.transfer")

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the generic package, then the CUDA-specific wheels
_MEM = {"cpu": "DRAM", "cuda": "VRAM"}


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
    prepped: bool = False


class Agent:
    """A named NIXL agent with the UCX backend; `close()` deregisters everything it registered.
    `ucx_params`, `progress_thread` and `pull_config` default to the settings (the environment)."""

    def __init__(self, name: str, *, ucx_params: dict[str, str] | None = None, progress_thread: bool | None = None,
                 pull_config: PullConfig | None = None) -> None:
        try:
            self.ucx_params = dict(settings.nixl_ucx_params() if ucx_params is None else ucx_params)
            PullConfig.from_env()  # a malformed MXLAUNCH_NIXL_PULL refuses the agent now, not mid-load
            self._pull_config = pull_config
        except MxlaunchError as exc:
            raise NixlUnavailable(exc.one_line()) from exc
        self.progress_thread = settings.nixl_progress_thread() if progress_thread is None else progress_thread
        api = import_nixl()
        started = time.perf_counter()
        try:
            config = api.nixl_agent_config(enable_prog_thread=self.progress_thread, backends=[])
            self._agent = api.nixl_agent(name, config)
        except Exception as exc:  # noqa: BLE001
            raise NixlUnavailable(f"NIXL could not start agent {name}: {exc}") from exc
        if "UCX" not in self._agent.get_plugin_list():
            raise NixlUnavailable("NIXL has no UCX backend here (its plugin did not load)")
        try:
            self._agent.create_backend("UCX", dict(self.ucx_params))
        except Exception as exc:  # noqa: BLE001
            extra = f" with UCX parameters {self.ucx_params}" if self.ucx_params else ""
            raise NixlUnavailable(f"NIXL could not start its UCX backend{extra}: {exc}") from exc
        self.name = name
        self.start_seconds = time.perf_counter() - started
        self._registered: list = []
        self._remotes: dict[bytes, object] = {}
        self.registrations = 0
        self.register_seconds = 0.0

    @property
    def pull_config(self) -> PullConfig:
        """The one given to the agent, else MXLAUNCH_NIXL_PULL as it is at each pull."""
        return self._pull_config if self._pull_config is not None else PullConfig.from_env()

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
             on_batch: Callable[[int], None] | None = None, chunk_bytes: int | None = None,
             inflight: int | None = None, op: str = "READ", prepped: bool | None = None,
             batch_bytes: int | None = None) -> PullStats:
        """READ every pair from the peer whose metadata is given: batches of descriptors, up to `inflight`
        of them posted at once; `chunk_bytes` > 0 splits big spans (more copies in parallel); `prepped`
        prepares both descriptor lists once and makes each request from them by index. Arguments left
        None come from `pull_config` (MXLAUNCH_NIXL_PULL), then the built-in defaults.
        `on_batch(i)` runs before batch i is posted (tests use it to kill a source mid-transfer).
        op="WRITE" moves the same spans the other way (local → peer; the push direction)."""
        cfg = self.pull_config
        if chunk_bytes is None:
            chunk_bytes = (cfg.chunk_mib or 0) << 20
        if inflight is None:
            inflight = cfg.inflight or 1
        if prepped is None:
            prepped = cfg.prepped
        if batch_bytes is None:
            batch_bytes = nixl_batches.BATCH_BYTES if cfg.batch_mib is None else (cfg.batch_mib << 20 or 1 << 62)
        stats = PullStats(prepped=prepped)
        started = time.perf_counter()
        remote = self.connect(remote_metadata)
        stats.connect_seconds = time.perf_counter() - started
        deadline = time.monotonic() + timeout_s
        work = nixl_batches.split(pairs, chunk_bytes) if chunk_bytes > 0 else list(pairs)
        total = sum(p.bytes for p in work)
        limit = batch_bytes if inflight <= 1 else max(1, -(-total // inflight))
        groups = nixl_batches.groups(work)
        pending: deque = deque()
        preps: dict[tuple[str, str], tuple] = {}
        landed = False
        t0 = time.perf_counter()
        try:
            if prepped:  # every list prepared before the first READ: a refusal here wrote nothing
                for key, group in groups.items():
                    preps[key] = self._prep(remote, group)
            for i, (key, lo, hi) in enumerate(nixl_batches.ranges(groups, limit)):
                if on_batch is not None:
                    on_batch(i)
                batch = groups[key][lo:hi]
                handle = self._post(remote, batch, landed, op, preps.get(key), (lo, hi), merge=cfg.merge)
                pending.append((handle, batch))
                landed = True
                while len(pending) >= max(1, inflight):
                    self._finish(remote, *pending.popleft(), deadline, stats)
            while pending:
                self._finish(remote, *pending.popleft(), deadline, stats)
        except TransferError:
            for handle, _ in pending:
                _release(self._agent, handle)
            pending.clear()
            self.disconnect(remote_metadata)
            raise
        finally:
            for local_h, remote_h in preps.values():
                _release_dlist(local_h)
                _release_dlist(remote_h)
        stats.transfer_seconds = time.perf_counter() - t0
        return stats

    def _prep(self, remote: object, group: list[Pair]) -> tuple:
        """Both sides' descriptor lists of one memory-kind group, prepared once (NIXL checks each span
        against the registrations here, not per request)."""
        first = group[0]
        local_h = None
        try:
            local_h = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(p.local_addr, p.bytes, p.local_dev) for p in group], _MEM[first.local_kind])
            remote_h = self._agent.prep_xfer_dlist(
                remote, [(p.remote_addr, p.bytes, p.remote_dev) for p in group], _MEM[first.remote_kind])
        except Exception as exc:  # noqa: BLE001 - e.g. a span the source has not registered
            _release_dlist(local_h)
            raise TransferError(f"NIXL refused to prepare the transfer from {_text(remote)}: {exc}",
                                landed=False) from exc
        return local_h, remote_h

    def _post(self, remote: object, batch: list[Pair], landed: bool, op: str = "READ", prep: tuple | None = None,
              span: tuple[int, int] = (0, 0), merge: bool = True) -> object:
        """Make and post one request (from the prepared lists when `prep` is given: indices `span`);
        a failure before the post means this batch wrote nothing."""
        try:
            if prep is not None:
                indices = list(range(*span))
                extra = {} if merge else {"skip_desc_merge": True}
                handle = self._agent.make_prepped_xfer(op, prep[0], indices, prep[1], indices, **extra)
            else:
                local = self._agent.get_xfer_descs([(p.local_addr, p.bytes, p.local_dev) for p in batch],
                                                   _MEM[batch[0].local_kind])
                far = self._agent.get_xfer_descs([(p.remote_addr, p.bytes, p.remote_dev) for p in batch],
                                                 _MEM[batch[0].remote_kind])
                handle = self._agent.initialize_xfer(op, local, far, remote)
        except Exception as exc:  # noqa: BLE001 - e.g. the source's memory is no longer registered
            raise TransferError(f"NIXL refused the transfer: {exc}", landed=landed) from exc
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - e.g. NIXL_ERR_REMOTE_DISCONNECT: the source is gone
            _settle(self._agent, handle)
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
        """Disconnect, deregister and destroy the native agent now. A process must not leave that to its
        exit: UCX's own teardown runs first there, and a request that a failed pull left inside UCX (a
        source that died mid-READ) then aborts the exiting process (the ucs_arbiter assertion)."""
        if self._agent is None:
            return
        for metadata in list(self._remotes):
            self.disconnect(metadata)
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:  # noqa: BLE001
                log.warning("mxlaunch: NIXL could not deregister memory: %s", exc)
        self._registered.clear()
        self._agent = None  # the last reference: the agent and its UCX worker are destroyed here


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


def _settle(agent, handle, seconds: float = 5.0) -> None:
    """Release a request that failed once UCX says it is no longer in progress (at most `seconds`): a post
    that fails midway (the source died) may have pieces in flight, and releasing them at once leaves more
    for UCX to clean up when the agent is destroyed. Best effort: UCX can still report one request it
    never got back (a warning at close), which is why close() must run before the interpreter's exit."""
    deadline = time.monotonic() + seconds
    try:
        while agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
    except Exception:  # noqa: BLE001 - the state of a request that never posted cannot be read
        pass
    _release(agent, handle)


def _release(agent, handle) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # noqa: BLE001 - a handle still in flight after a timeout cannot be released
        pass


def _release_dlist(handle) -> None:
    if handle is None:
        return
    try:
        handle.release()
    except Exception:  # noqa: BLE001
        pass


def _backend(agent, handle) -> str:
    try:
        return str(agent.query_xfer_backend(handle))
    except Exception:  # noqa: BLE001
        return "UCX"


def _text(name: object) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)
