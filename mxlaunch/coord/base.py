"""What every coordinator offers: claims with a lease, so N replicas racing on a new model capture it once.

A backend (the shared filesystem in `file.py`, an S3 bucket in `s3.py`) implements `Coordinator`, its claims
on `LeasedClaim` (the lease's thread and state; the backend says how a beat and a release are written); the launcher and
the store only talk to these protocols. A claim is an optimisation, not the safety net: the store's
manifest publish is exactly-once on its own, so even two captures of one source id publish one snapshot.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Protocol, runtime_checkable

SCHEMA = 1

# Source ids (and capture ids) become file and key names: keep them to one safe path component.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_id(name: object) -> bool:
    """True for one safe path component: letters, digits, '.', '_', '-', not starting with a dot."""
    return isinstance(name, str) and bool(_ID_RE.match(name)) and ".." not in name


@dataclass(frozen=True)
class ClaimInfo:
    """Who holds a claim and until when (the JSON record stored by a backend)."""

    source_id: str
    token: str
    host: str
    pid: int
    boot_id: str
    start_time: int  # the holder's process start time (clock ticks since boot; 0 when unknown)
    created_at: float  # epoch seconds
    expires_at: float  # epoch seconds; the lease ends here unless a heartbeat extends it
    ttl_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. {"capture_id": ...} for a replica's other nodes
    released: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: object) -> Optional["ClaimInfo"]:
        """Validate a stored record; None when it is not one (a reader treats that as unknown, not as free)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return None
        try:
            info = cls(
                source_id=data["source_id"], token=data["token"], host=data["host"], pid=data["pid"],
                boot_id=data["boot_id"], start_time=data["start_time"], created_at=float(data["created_at"]),
                expires_at=float(data["expires_at"]), ttl_s=float(data["ttl_s"]), extra=data.get("extra") or {},
                released=data.get("released", False),
            )
        except (KeyError, TypeError, ValueError):
            return None
        ok = (
            valid_id(info.source_id) and isinstance(info.token, str) and isinstance(info.host, str)
            and isinstance(info.pid, int) and isinstance(info.boot_id, str) and isinstance(info.start_time, int)
            and isinstance(info.extra, dict) and isinstance(info.released, bool)
        )
        return info if ok else None

    def remaining_s(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)

    def describe(self) -> str:
        left = self.remaining_s()
        lease = f"lease {left:.0f} s left" if left >= 0 else f"lease expired {-left:.0f} s ago"
        return f"{self.host} pid {self.pid} ({lease})"


@runtime_checkable
class Claim(Protocol):
    """A held claim. `heartbeat()` extends the lease; False means the claim is lost (stop capturing)."""

    source_id: str
    token: str

    @property
    def info(self) -> ClaimInfo: ...

    @property
    def lost(self) -> bool: ...

    def heartbeat(self) -> bool: ...

    def keep_alive(self, interval_s: float | None = None) -> None: ...

    def release(self) -> None: ...


class LeasedClaim:
    """A claim this process holds, its lease kept by a daemon thread. A backend writes the record: `_beat(info)`
    (True: written; False: the claim is no longer this process's), and may refuse a beat it knows is lost
    before writing (`_still_mine`). `transient` are the errors a beat survives (the next one retries)."""

    transient: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, info: ClaimInfo) -> None:
        self._info = info
        self.source_id = info.source_id
        self.token = info.token
        self._lost = threading.Event()
        self._released = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def info(self) -> ClaimInfo:
        return self._info

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def _still_mine(self, now: float) -> bool:
        if now >= self._info.expires_at:
            self._lost.set()  # expired: a racer may take over from now on
            return False
        return True

    def _beat(self, info: ClaimInfo) -> bool:
        raise NotImplementedError

    def _write(self, info: ClaimInfo) -> bool:
        if self._beat(info):
            self._info = info
            return True
        self._lost.set()
        return False

    def heartbeat(self) -> bool:
        """Extend the lease by ttl_s. False (and `lost`) once the lease ran out or another launcher took it."""
        with self._lock:
            if self._released or self.lost or not self._still_mine(time.time()):
                return False
            return self._write(replace(self._info, expires_at=time.time() + self._info.ttl_s))

    def keep_alive(self, interval_s: float | None = None) -> None:
        """Heartbeat from a daemon thread every interval (default ttl/3) until release() or the claim is lost."""
        if self._thread is not None:
            return
        interval = self._info.ttl_s / 3 if interval_s is None else interval_s

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    if not self.heartbeat():
                        return
                except self.transient:
                    continue  # the next beat retries before the lease ends

        self._thread = threading.Thread(target=loop, name=f"mxlaunch-claim-{self.source_id}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the claim back (idempotent); a lost or expired claim is left alone."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._released:
                return
            self._released = True
            if not self.lost and self._still_mine(time.time()):
                try:
                    self._write(replace(self._info, expires_at=0.0, released=True))
                except self.transient:
                    pass  # the lease then simply runs out

    def __enter__(self) -> "LeasedClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@runtime_checkable
class Coordinator(Protocol):
    """The claim registry: one winner per source id; a dead holder's claim can be taken over."""

    def try_claim(self, source_id: str, ttl_s: float = 30.0, *, extra: dict[str, Any] | None = None) -> Optional[Claim]:
        """The claim when this caller wins, None when a live holder has it."""
        ...

    def holder(self, source_id: str) -> Optional[ClaimInfo]:
        """The live holder of a claim, or None (free, or its holder is gone)."""
        ...
