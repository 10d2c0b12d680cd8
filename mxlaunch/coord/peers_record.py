"""The P2P source record and what both registry backends share: validation, staleness, the heartbeat loop.

The public interface is `mxlaunch/coord/peers.py` (it re-exports these names); the backends
(`peers_file.py`, `peers_redis.py`) import from here so that peers.py can open either without an import
circle. Light on purpose: engine workers import it (no torch, no redis).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

from mxlaunch.coord.base import valid_id
from mxlaunch.errors import MxlaunchError, UsageError
from mxlaunch.fileutil import boot_id, pid_alive, process_start_time
from mxlaunch.transfer.ipc_handoff import ADDRESS as IPC_ADDRESS  # stdlib only, like this module

SCHEMA = 1
LAYOUTS = ("raw", "processed")
DEVICES = ("cpu", "cuda")
LIVE, STALE = "live", "stale"
PEER_STATES = (LIVE, STALE)
TENSOR_KEYS = ("name", "dtype", "shape", "bytes", "addr", "dev")
MAX_RECORD_BYTES = 32 << 20  # a record is JSON of a tensor list: ~150 bytes a tensor, far below this
MAX_BEAT_BYTES = 4096
DEFAULT_TTL_S = 15.0

# ---- the record ----------------------------------------------------------------------------------------


def _is_int(x: object, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _short_str(x: object, most: int, empty: bool = False) -> bool:
    return isinstance(x, str) and (empty or bool(x)) and len(x) <= most


def valid_tensors(tensors: object) -> bool:
    """A list of manifest entries {name, dtype, shape, bytes, addr, dev} with sane types and unique names;
    an entry's optional "digest" (transfer/digest.py: "algo:hex") is a short string."""
    if not isinstance(tensors, list):
        return False
    names = set()
    for t in tensors:
        if not isinstance(t, dict) or any(k not in t for k in TENSOR_KEYS):
            return False
        shape = t["shape"]
        if not (_short_str(t["name"], 1024) and _short_str(t["dtype"], 64) and isinstance(shape, list)
                and len(shape) <= 32 and all(_is_int(d) for d in shape)
                and _is_int(t["bytes"]) and _is_int(t["addr"]) and _is_int(t["dev"])
                and ("digest" not in t or _short_str(t["digest"], 128))):
            return False
        names.add(t["name"])
    return len(names) == len(tensors)


def _valid_b64(text: object) -> bool:
    if not isinstance(text, str) or not text:
        return False
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


IPC_HANDOFF = "cuda_ipc_handoff"  # extra: {"socket": "@mxlaunch-ipc-…", "allocations": n} (transfer/ipc_handoff.py)
IPC_HANDLES = "cuda_ipc"  # extra: where mxlaunch before the handoff wrote the handles themselves; never published


def valid_ipc_handoff(value: object) -> bool:
    """Absent, or the handoff socket's address (an abstract Unix socket name of ours) and a count: a record
    names where a same-uid peer asks for the CUDA IPC handles, never the handles."""
    if value is None:
        return True
    return (isinstance(value, dict) and set(value) == {"socket", "allocations"} and isinstance(value["socket"], str)
            and bool(IPC_ADDRESS.fullmatch(value["socket"])) and _is_int(value["allocations"], 1))


@dataclass(frozen=True)
class SourceRecord:
    """One worker offering the weights of one rank of a source id (what a backend stores, as JSON)."""

    source_id: str
    rank: int
    world: int  # number of snapshot ranks of that replica
    layout: str  # "raw" | "processed"
    worker: str  # unique id of the worker, also its NIXL agent name: one safe path component
    host: str
    pid: int
    boot_id: str
    start_time: int  # the worker's process start time (clock ticks since boot; 0 when unknown)
    run_id: str  # the launcher's run id: the launcher drops its run's records on exit
    device: str  # "cpu" | "cuda"
    agent_metadata: str  # base64 of the NIXL agent metadata bytes (opaque here)
    tensors: list[dict]  # {"name", "dtype", "shape", "bytes", "addr", "dev"} per tensor
    created_at: float
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: object) -> Optional["SourceRecord"]:
        """Validate a stored record strictly; None when it is not a valid record of this schema."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return None
        try:
            rec = cls(**{k: data[k] for k in _FIELDS if k not in ("created_at", "extra")},
                      created_at=data["created_at"], extra=data.get("extra", {}))
        except (KeyError, TypeError):
            return None
        if _is_num(rec.created_at) and isinstance(rec.created_at, int):
            rec = replace(rec, created_at=float(rec.created_at))
        ok = (
            valid_id(rec.source_id) and _is_int(rec.world, 1) and _is_int(rec.rank) and rec.rank < rec.world
            and rec.layout in LAYOUTS and valid_id(rec.worker) and _short_str(rec.host, 255)
            and _is_int(rec.pid, 1) and _short_str(rec.boot_id, 64, empty=True) and _is_int(rec.start_time)
            and valid_id(rec.run_id) and rec.device in DEVICES and _valid_b64(rec.agent_metadata)
            and valid_tensors(rec.tensors) and _is_num(rec.created_at) and isinstance(rec.extra, dict)
            and valid_ipc_handoff(rec.extra.get(IPC_HANDOFF))
        )
        return rec if ok else None

    @property
    def total_bytes(self) -> int:
        return sum(t["bytes"] for t in self.tensors)

    def metadata_bytes(self) -> bytes:
        """The NIXL agent metadata, decoded."""
        return base64.b64decode(self.agent_metadata)

    def same_publisher(self, other: "SourceRecord") -> bool:
        """Is `other` the record this one's publisher wrote (not a later one under the same worker id)?"""
        return (self.host, self.pid, self.boot_id, self.start_time, self.created_at) == \
               (other.host, other.pid, other.boot_id, other.start_time, other.created_at)


_FIELDS = tuple(SourceRecord.__dataclass_fields__)


def local_record(source_id: str, rank: int, world: int, *, layout: str, worker: str, run_id: str, device: str,
                 agent_metadata: bytes | str, tensors: list[dict], extra: dict | None = None) -> SourceRecord:
    """A record for this process: host, pid, boot id, start time and created_at filled in."""
    meta = agent_metadata if isinstance(agent_metadata, str) else base64.b64encode(agent_metadata).decode()
    pid = os.getpid()
    return SourceRecord(
        source_id=source_id, rank=rank, world=world, layout=layout, worker=worker, host=socket.gethostname(),
        pid=pid, boot_id=boot_id(), start_time=process_start_time(pid), run_id=run_id, device=device,
        agent_metadata=meta, tensors=tensors, created_at=time.time(), extra=dict(extra or {}),
    )


def check_record(record: SourceRecord) -> None:
    """Refuse to publish what a reader would refuse to read."""
    if SourceRecord.from_json(record.to_json()) is None:
        raise UsageError(f"source record for {record.source_id!r} rank {record.rank!r} worker {record.worker!r} "
                         "is not valid", "see SourceRecord in mxlaunch/coord/peers.py for each field's rules")
    if IPC_HANDLES in record.extra:  # whoever reads the record could open them: read and write to the GPU memory
        raise UsageError(f"source record for {record.source_id!r} rank {record.rank} carries CUDA IPC handles",
                         "hand them over the source's socket (transfer/ipc_handoff.py), never in a record")


@dataclass(frozen=True)
class Beat:
    """A heartbeat: when it was written, how long it counts, and the run that published the record."""

    at: float
    ttl_s: float
    run_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "ttl_s": self.ttl_s, "run_id": self.run_id}

    @classmethod
    def from_json(cls, data: object) -> Optional["Beat"]:
        if not isinstance(data, dict) or not _is_num(data.get("at")) or not _is_num(data.get("ttl_s")):
            return None
        run_id = data.get("run_id", "")
        if data["ttl_s"] <= 0 or not isinstance(run_id, str):
            return None
        return cls(float(data["at"]), float(data["ttl_s"]), run_id)


# ---- what readers get ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerEntry:
    """A record with its state: live or stale, when it last beat, and how long ago."""

    record: SourceRecord
    state: str  # "live" | "stale"
    heartbeat_at: float
    age_s: float  # since the last heartbeat
    ttl_s: float = 0.0  # the heartbeat's ttl (0: no heartbeat found)
    reason: str = ""  # why stale: "no heartbeat", "heartbeat older than its ttl", "process gone"

    def to_json(self) -> dict[str, Any]:
        rec = self.record
        return {"source_id": rec.source_id, "rank": rec.rank, "world": rec.world, "layout": rec.layout,
                "device": rec.device, "host": rec.host, "pid": rec.pid, "worker": rec.worker,
                "run_id": rec.run_id, "state": self.state, "reason": self.reason,
                "heartbeat_at": self.heartbeat_at, "age_s": round(self.age_s, 3), "ttl_s": self.ttl_s,
                "tensors": len(rec.tensors), "bytes": rec.total_bytes, "created_at": rec.created_at}


def judge(record: SourceRecord, beat: Optional[Beat], *, host: str, boot: str, now: float | None = None,
          beat_expired: Optional[bool] = None) -> PeerEntry:
    """The record's state. `beat_expired` lets a backend with server-side expiry (Redis) decide the ttl part."""
    now = time.time() if now is None else now
    at = beat.at if beat is not None else record.created_at
    reason = ""
    if beat is None:
        reason = "no heartbeat"
    elif beat_expired if beat_expired is not None else now - beat.at > beat.ttl_s:
        reason = "heartbeat older than its ttl"
    elif record.host == host and record.boot_id and record.boot_id == boot \
            and not pid_alive(record.pid, record.start_time):
        reason = "process gone"
    return PeerEntry(record, STALE if reason else LIVE, at, max(0.0, now - at),
                     beat.ttl_s if beat is not None else 0.0, reason)


def reapable(entry: PeerEntry, grace_s: float, now: float | None = None) -> bool:
    """Stale for longer than grace_s: a gone process at once, an old heartbeat grace_s after its ttl ran out."""
    if entry.state != STALE:
        return False
    if entry.reason == "process gone":
        return True
    now = time.time() if now is None else now
    return now - (entry.heartbeat_at + entry.ttl_s) > grace_s


def ordered(entries: list[PeerEntry]) -> list[PeerEntry]:
    """Live first, newest heartbeat first."""
    return sorted(entries, key=lambda e: (e.state != LIVE, -e.heartbeat_at))


# ---- the heartbeat loop both backends share ----------------------------------------------------------


VERIFY_POLL_S = 1.0  # how often a source looks for a `peers --verify` request between heartbeats


class BasePublication:
    """The heartbeat loop both backends share; a backend supplies `_beat()` and `_drop()`, and for
    `mxlaunch peers --verify` `_pending_verify()` (a request's nonce, taken) and `_answer_verify()`.
    `verifier` (set by the plugin) recomputes the served bytes' checksums: {"ok", "bad", ...}; a source
    that finds its own bytes changed answers so and stops offering itself."""

    verifier: Optional[Callable[[], dict]] = None

    def __init__(self, record: SourceRecord, ttl_s: float) -> None:
        self.record = record
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gone = False
        self._thread: Optional[threading.Thread] = None

    def _beat(self) -> bool:  # write a heartbeat if the record still exists; False when it is gone
        raise NotImplementedError

    def _pending_verify(self) -> Optional[str]:  # the nonce of a verify request (removed), or None
        return None

    def _answer_verify(self, nonce: str, result: dict) -> None:
        raise NotImplementedError

    def answer_verify_request(self) -> Optional[dict]:
        """Answer a pending `peers --verify` request (the heartbeat thread calls this); returns the result."""
        if self.verifier is None or self._gone:
            return None
        nonce = self._pending_verify()
        if nonce is None:
            return None
        try:
            result = dict(self.verifier())
        except Exception as exc:  # noqa: BLE001 - say so rather than pass
            result = {"ok": False, "bad": [], "error": str(exc)[:300]}
        self._answer_verify(nonce, {**result, "worker": self.record.worker, "at": time.time()})
        if not result.get("ok"):
            self.unpublish()  # its bytes are not what it published: no target may pull them
        return result

    def _drop(self) -> None:  # remove the record and its heartbeat, if they are still this publisher's
        raise NotImplementedError

    @property
    def lost(self) -> bool:
        return self._gone

    def heartbeat(self) -> bool:
        with self._lock:
            if self._gone:
                return False
            if not self._beat():
                self._gone = True
            return not self._gone

    def keep_alive(self, interval_s: float | None = None) -> None:
        """Heartbeat from a daemon thread every interval (default ttl/3) until unpublish() or the record is gone;
        between beats, look for a `peers --verify` request every VERIFY_POLL_S (one small read), so the
        one asking waits about a second, not up to a whole interval."""
        if self._thread is not None:
            return
        interval = self.ttl_s / 3 if interval_s is None else interval_s

        def loop() -> None:
            next_beat = time.monotonic() + interval
            while not self._stop.wait(max(0.0, min(VERIFY_POLL_S, next_beat - time.monotonic()))):
                try:
                    if time.monotonic() >= next_beat:
                        next_beat = time.monotonic() + interval
                        if not self.heartbeat():
                            return
                    self.answer_verify_request()
                except (OSError, MxlaunchError):
                    continue  # transient (filesystem, network): the next beat retries before the ttl ends

        self._thread = threading.Thread(target=loop, name=f"mxlaunch-peer-{self.record.worker}", daemon=True)
        self._thread.start()

    def unpublish(self) -> None:
        """Remove the record (idempotent); stops keep_alive; a record someone else replaced is left alone."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._gone:
                return
            self._gone = True
            self._drop()

    def __enter__(self) -> "BasePublication":
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpublish()


def check_ttl(ttl_s: float) -> None:
    if not _is_num(ttl_s) or ttl_s <= 0:
        raise UsageError(f"heartbeat ttl {ttl_s} must be > 0", "pass a ttl in seconds")



def redact_url(url: str) -> str:
    """The URL without its password or secret query values, for tables and logs (mxlaunch/safety/redact.py)."""
    from mxlaunch.safety.redact import redact_url as _redact

    return _redact(url)
