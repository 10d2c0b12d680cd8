"""Claims in an S3 bucket (the coordinator of an `s3://` artifact store, store/s3_store.py).

A claim on a source id is one object, `<prefix>/.claims/<source_id>.claim`, holding a JSON `ClaimInfo`
(host, pid, boot id, process start time, expires_at). Every change to it is a conditional PUT, so S3
itself picks the one winner of each race (no lock service beside the bucket):

- claim:     no object → PUT with `If-None-Match: *` (one creator wins, the others get 412). An object
             whose holder is gone (released, its lease ended more than `grace_s` ago, or its process is
             dead on this very host and boot) → PUT with `If-Match: <the ETag read>`: a compare-and-swap,
             so of N launchers taking over the same expired claim exactly one succeeds.
- heartbeat: the holder PUTs a later expiry with `If-Match: <its own last ETag>`; a 412 means another
             launcher took the claim over (after the lease ran out): the claim is `lost`.
- release:   the same conditional PUT, marked released (expires_at 0).

The race window, honestly: expiry is judged on the reader's clock against the holder's. A holder whose
heartbeats stall past its lease (a paused process, a partitioned node, clocks skewed by more than
`grace_s`) can be taken over while it still believes it holds the claim; it learns so at its next
heartbeat (at most ttl/3 later, the conditional PUT fails). In that window two captures of one source id may
run; that costs bytes, never correctness: the manifest's own publish is a `PUT If-None-Match: *` too, so
exactly one capture publishes and the loser discards its files (store/s3_store.py).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any, Optional, Union

from mxlaunch.coord.base import ClaimInfo, LeasedClaim, valid_id
from mxlaunch.errors import UsageError
from mxlaunch.fileutil import boot_id, pid_alive, process_start_time

if TYPE_CHECKING:
    from mxlaunch.store.s3_store import S3Store

CLAIMS = ".claims"
_UNREADABLE_STALE_S = 30.0  # a record that cannot be parsed counts as held until it is this old (+ grace)
_RACE_LOST = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey", "404")


def _race_lost(exc: BaseException) -> bool:
    """A conditional PUT that lost (someone else wrote first, or the object went)."""
    from botocore.exceptions import ClientError  # noqa: PLC0415 — boto3 is an extra

    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code", "")) in _RACE_LOST


class S3Claim(LeasedClaim):
    """A claim this process holds; `etag` is the ETag of the record it last wrote (every write is a PUT
    If-Match that ETag: a take-over in between makes it fail, and the claim is lost)."""

    transient = (Exception,)  # a beat that failed for any other reason than a lost race: S3's errors vary

    def __init__(self, coordinator: "S3Coordinator", info: ClaimInfo, etag: str) -> None:
        super().__init__(info)
        self._coord = coordinator
        self.etag = etag

    def _beat(self, info: ClaimInfo) -> bool:
        try:
            self.etag = self._coord.put(self.source_id, info, {"IfMatch": self.etag})
        except Exception as exc:  # noqa: BLE001
            if _race_lost(exc):
                return False
            raise
        return True


class S3Coordinator:
    """Claims under `<prefix>/.claims/` of an S3 store. `host` is overridable for tests (another host:
    no pid check)."""

    def __init__(self, store: "S3Store", *, host: str | None = None, grace_s: float = 2.0) -> None:
        self.store = store
        self.host = host or socket.gethostname()
        self.grace_s = grace_s
        self._boot_id = boot_id()

    def key(self, source_id: str) -> str:
        if not valid_id(source_id):
            raise UsageError(f"{source_id!r} is not a valid source id", "use the id `mxlaunch store list` shows")
        return self.store.key(CLAIMS, f"{source_id}.claim")

    def put(self, source_id: str, info: ClaimInfo, condition: dict[str, str]) -> str:
        resp = self.store.s3.put_object(Bucket=self.store.bucket, Key=self.key(source_id),
                                        Body=json.dumps(info.to_json()).encode(), ContentType="application/json",
                                        **condition)
        return str(resp.get("ETag", ""))

    def read(self, source_id: str) -> tuple[Union[ClaimInfo, str, None], str, float]:
        """(the record — None when there is none, "unreadable" when it is not one —, its ETag, its age in s)."""
        got = self.store.get_object(self.key(source_id), limit=1 << 20)
        if got is None:
            return None, "", 0.0
        body, etag, modified = got
        try:
            info: Union[ClaimInfo, str, None] = ClaimInfo.from_json(json.loads(body))
        except ValueError:
            info = None
        return (info if info is not None else "unreadable"), etag, time.time() - modified

    def _stale(self, info: Union[ClaimInfo, str], age_s: float) -> bool:
        now = time.time()
        if not isinstance(info, ClaimInfo):
            return age_s > _UNREADABLE_STALE_S + self.grace_s
        if info.released or now > info.expires_at + self.grace_s:
            return True
        if info.host == self.host and info.boot_id == self._boot_id and info.boot_id:
            return not pid_alive(info.pid, info.start_time)  # its process is gone: no need to wait for the lease
        return False

    def try_claim(self, source_id: str, ttl_s: float = 30.0, *, extra: dict[str, Any] | None = None) -> Optional[S3Claim]:
        if ttl_s <= 0:
            raise UsageError(f"claim ttl {ttl_s} must be > 0", "pass a lease length in seconds")
        for _ in range(4):
            current, etag, age = self.read(source_id)
            if current is not None and not self._stale(current, age):
                return None
            now = time.time()
            info = ClaimInfo(source_id=source_id, token=secrets.token_hex(16), host=self.host, pid=os.getpid(),
                             boot_id=self._boot_id, start_time=process_start_time(os.getpid()), created_at=now,
                             expires_at=now + ttl_s, ttl_s=float(ttl_s), extra=dict(extra or {}))
            try:
                new_etag = self.put(source_id, info, {"IfNoneMatch": "*"} if current is None else {"IfMatch": etag})
            except Exception as exc:  # noqa: BLE001
                if _race_lost(exc):
                    continue  # another launcher wrote first: look again (it is live, so we lose)
                raise
            return S3Claim(self, info, new_etag)
        return None

    def holder(self, source_id: str) -> Optional[ClaimInfo]:
        current, _, age = self.read(source_id)
        return current if isinstance(current, ClaimInfo) and not self._stale(current, age) else None
