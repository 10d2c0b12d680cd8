"""The P2P source registry: which live engine workers hold the weights of one rank of a source id.

A serving worker publishes a `SourceRecord` (where its tensors sit, its NIXL agent metadata) and keeps
a heartbeat; a new replica asks `sources(source_id, rank)` for live ones and pulls from one. A record
holds addresses and NIXL metadata, never weights, and it is only JSON: every record read back is
validated here before anyone uses it.

Backends: the shared filesystem (`peers_file.py`, the default, next to the artifact store) and Redis
(`peers_redis.py`). This module stays light (no torch, no redis): it runs inside engine workers.

A record is stale when its heartbeat is older than its ttl, or when it ran on this host (same boot id)
and its process (pid + start time) is gone. Stale records are never handed out as sources.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from mxlaunch import settings
from mxlaunch.coord.peers_record import (  # the public names (__all__); defined there
    DEFAULT_TTL_S, DEVICES, LAYOUTS, LIVE, MAX_BEAT_BYTES, MAX_RECORD_BYTES, PEER_STATES, SCHEMA, STALE, TENSOR_KEYS,
    Beat, PeerEntry, SourceRecord, judge, local_record, redact_url, valid_tensors)
from mxlaunch.errors import UsageError

PeerState = Literal["live", "stale"]  # PeerEntry.state

__all__ = ["DEFAULT_TTL_S", "DEVICES", "LAYOUTS", "LIVE", "MAX_BEAT_BYTES", "MAX_RECORD_BYTES", "PEER_STATES", "SCHEMA",
           "STALE", "TENSOR_KEYS", "Beat", "PeerEntry", "PeerRegistry", "PeerState", "Publication", "SourceRecord",
           "judge", "local_record", "open_registry", "redact_url", "valid_tensors"]

# ---- the interfaces ------------------------------------------------------------------------------------


@runtime_checkable
class Publication(Protocol):
    """A published record. heartbeat() is False once the record is gone (a reaper or someone removed it)."""

    record: SourceRecord

    def heartbeat(self) -> bool: ...

    def keep_alive(self, interval_s: float | None = None) -> None: ...

    def unpublish(self) -> None: ...


@runtime_checkable
class PeerRegistry(Protocol):
    """Where sources are published and found; `url` is for display and the plan file."""

    url: str

    def publish(self, record: SourceRecord, ttl_s: float = DEFAULT_TTL_S) -> Publication: ...

    def sources(self, source_id: str, rank: int | None = None, *, include_stale: bool = False) -> list[PeerEntry]: ...

    def all_sources(self, *, include_stale: bool = True) -> list[PeerEntry]: ...

    def remove(self, source_id: str, rank: int, worker: str) -> bool: ...

    def remove_run(self, run_id: str) -> int: ...

    def reap(self, grace_s: float = 60.0) -> int: ...

    def request_verify(self, source_id: str, rank: int, worker: str) -> str: ...

    def verify_answer(self, source_id: str, rank: int, worker: str, nonce: str) -> dict | None: ...


# ---- opening one ---------------------------------------------------------------------------------------


def open_registry(url: str | None, store_root: Path | None) -> PeerRegistry:
    """The registry a URL names. None: $MXLAUNCH_REGISTRY, else the file registry in the store.

    "file" → `<store_root>/.peers`; "file:/dir" (or file:///dir) → `/dir/.peers`; "redis://…" or
    "rediss://…" → Redis (the package is imported only then).
    """
    url = url if url else settings.registry()
    if not url or url == "file":
        from mxlaunch.coord.peers_file import FileRegistry
        from mxlaunch.store.snapshot import default_root

        return FileRegistry(Path(store_root).expanduser() if store_root is not None else default_root())
    if url.startswith("file:"):
        from mxlaunch.coord.peers_file import FileRegistry

        path = url[len("file://"):] if url.startswith("file://") else url[len("file:"):]
        if not path.startswith(("/", "~")):
            raise UsageError(f"registry URL {url!r} needs an absolute path", "use file:/abs/dir or file")
        return FileRegistry(Path(path).expanduser())
    if url.startswith(("redis://", "rediss://")):
        from mxlaunch.coord.peers_redis import RedisRegistry

        return RedisRegistry(url)
    raise UsageError(f"unknown registry URL {redact_url(url)!r}",
                     "use file (the artifact store), file:/dir or redis://host:port/db")
