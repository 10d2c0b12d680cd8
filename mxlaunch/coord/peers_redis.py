"""The P2P source registry in Redis, for clusters without a shared filesystem fast enough to poll.

Keys (prefix `mxlaunch`; `:` never occurs in a source id, rank or worker id):

    mxlaunch:peers:<source_id>:<rank>            hash  worker → SourceRecord JSON (written once, HSETNX)
    mxlaunch:beats:<source_id>:<rank>            hash  worker → last heartbeat {"at", "ttl_s", "run_id"}
    mxlaunch:beat:<source_id>:<rank>:<worker>    string, SET with PX ttl: while it exists the record is live
    mxlaunch:owners:<source_id>:<rank>           hash  worker → the publication's random token (heartbeats
                                                 and unpublish touch only their own record)
    mxlaunch:sources                             set   "<source_id>:<rank>" of every hash above (all_sources)
    mxlaunch:run:<run_id>                        set   "<source_id>:<rank>:<worker>" a run published (remove_run)
    mxlaunch:verify:<source_id>:<rank>:<worker>  string, PX 60 s: a `peers --verify` request's nonce
    mxlaunch:verified:<source_id>:<rank>:<worker> string, PX 120 s: the source's answer (JSON with the nonce)

Liveness comes from the server's own expiry (no clock skew between hosts); the `beats` hash keeps the
last heartbeat for display and for reaping. Publish, heartbeat and remove are Lua scripts: each is one
atomic step on the server (the scripts, the connection's auth rule and value decoding: peers_redis_wire.py).
`redis` is imported only there, and only when a redis:// registry is opened.

Whoever can connect to the database can read every record (and so reach every source's memory) and write
records a target would trust, so a URL without a password is refused (`wire.check_auth`) unless
MXLAUNCH_REDIS_PASSWORD supplies one or MXLAUNCH_REDIS_TRUSTED=1 says no one else reaches the network.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional

from mxlaunch import settings
from mxlaunch.coord import peers_redis_wire as wire
from mxlaunch.coord.base import valid_id
from mxlaunch.coord.peers_record import (
    DEFAULT_TTL_S, MAX_RECORD_BYTES, STALE, Beat, BasePublication, PeerEntry, SourceRecord,
    check_record, check_ttl, judge, ordered, reapable, redact_url)
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.fileutil import boot_id


class RedisPublication(BasePublication):
    """A record this process published in Redis."""

    def __init__(self, registry: "RedisRegistry", record: SourceRecord, ttl_s: float, token: str) -> None:
        super().__init__(record, ttl_s)
        self._reg = registry
        self._token = token  # stored with the record: beats and unpublish touch it only while it is ours

    def _beat(self) -> bool:
        r = self.record
        beat = json.dumps(Beat(time.time(), self.ttl_s, r.run_id).to_json())
        with self._reg._io():
            keys = self._reg._keys(r.source_id, r.rank, r.worker)
            return bool(self._reg._beat_script(keys=keys, args=[r.worker, beat, wire.ms(self.ttl_s), self._token]))

    def _pending_verify(self) -> Optional[str]:
        r = self.record
        with self._reg._io():
            raw = self._reg._db.getdel(self._reg._verify_key("verify", r.source_id, r.rank, r.worker))
        nonce = wire.as_text(raw)
        return nonce if nonce and valid_id(nonce) else None

    def _answer_verify(self, nonce: str, result: dict) -> None:
        r = self.record
        with self._reg._io():
            self._reg._db.set(self._reg._verify_key("verified", r.source_id, r.rank, r.worker),
                              json.dumps({**result, "nonce": nonce}), px=120_000)

    def _drop(self) -> None:
        r = self.record
        self._reg._remove(r.source_id, r.rank, r.worker, expected=self._token, run_id=r.run_id)


class RedisRegistry:
    """Source records in one Redis database. `host` is overridable for tests (another host: no pid check)."""

    def __init__(self, url: str, *, host: str | None = None, prefix: str = "mxlaunch") -> None:
        password = wire.check_auth(url)
        self._redis = wire.import_redis()
        self.url = url
        self.refusals: list[str] = []  # the file registry's mode checks have no Redis counterpart
        self.prefix = prefix
        self.host = host or socket.gethostname()
        self._boot_id = boot_id()
        try:
            extra = {"password": password} if password else {}
            self._db = self._redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10, **extra)
        except ValueError as exc:
            raise UsageError(f"registry URL {redact_url(url)!r} is not a Redis URL ({exc})",
                             "use redis://host:port/db") from exc
        self._publish_script = self._db.register_script(wire.PUBLISH)
        self._beat_script = self._db.register_script(wire.BEAT)
        self._remove_script = self._db.register_script(wire.REMOVE)
        self._prune_script = self._db.register_script(wire.PRUNE)
        with self._io():
            self._db.ping()

    @contextmanager
    def _io(self) -> Iterator[None]:
        """Redis errors become one-line usage errors that name the URL and the fix."""
        errors = self._redis.exceptions
        where = redact_url(self.url)
        try:
            yield
        except errors.AuthenticationError as exc:
            raise UsageError(f"the peer registry at {where} refused our login ({exc})",
                             f"put the right password in the URL (redis://:PASSWORD@host:port/db) or in "
                             f"{settings.REDIS_PASSWORD}") from exc
        except (errors.ConnectionError, errors.TimeoutError) as exc:
            raise UsageError(f"cannot reach the peer registry at {where} ({exc})",
                             "start redis-server there, or pass --registry file (or unset MXLAUNCH_REGISTRY)") from exc
        except errors.RedisError as exc:
            raise UsageError(f"the peer registry at {where} failed a command ({exc})",
                             "check that the database holds only mxlaunch's keys, or pick another db in the URL") from exc

    # ---- keys ----

    def _keys(self, source_id: str, rank: int, worker: str, run_id: str = "") -> list[str]:
        """record hash, beats hash, beat key, sources set, run set, owners hash."""
        wire.check_key(source_id, rank, worker)
        p = self.prefix
        return [f"{p}:peers:{source_id}:{rank}", f"{p}:beats:{source_id}:{rank}",
                f"{p}:beat:{source_id}:{rank}:{worker}", f"{p}:sources", f"{p}:run:{run_id or '-'}",
                f"{p}:owners:{source_id}:{rank}"]

    # ---- writing ----

    def publish(self, record: SourceRecord, ttl_s: float = DEFAULT_TTL_S) -> RedisPublication:
        """Store the record and its first heartbeat in one step; a live record under the same worker refuses."""
        check_ttl(ttl_s)
        check_record(record)
        r = record
        text = json.dumps(record.to_json())
        if len(text) > MAX_RECORD_BYTES:
            raise UsageError(f"source record of {r.source_id} rank {r.rank} is {len(text)} bytes",
                             f"readers refuse records over {MAX_RECORD_BYTES} bytes")
        keys = self._keys(r.source_id, r.rank, r.worker, r.run_id)
        for _ in range(8):
            beat = json.dumps(Beat(time.time(), ttl_s, r.run_id).to_json())
            token = secrets.token_hex(16)
            args = [r.worker, text, beat, wire.ms(ttl_s), f"{r.source_id}:{r.rank}", f"{r.source_id}:{r.rank}:{r.worker}",
                    token]
            with self._io():
                if self._publish_script(keys=keys, args=args):
                    return RedisPublication(self, record, ttl_s, token)
            found = self._load(r.source_id, r.rank, [r.worker], time.time()).get(r.worker)
            if found is None:
                continue  # removed meanwhile: try again
            held, owner = found
            if held.state != STALE if isinstance(held, PeerEntry) else isinstance(held, _Unreadable) and held.live:
                who = f" (pid {held.record.pid} on {held.record.host})" if isinstance(held, PeerEntry) else ""
                raise CheckFailed(f"worker {r.worker} already publishes {r.source_id} rank {r.rank}{who}",
                                  "give each worker a unique id, or unpublish the old record first")
            self._remove(r.source_id, r.rank, r.worker, expected=owner)  # a stale record under our id: replace it
        raise CheckFailed(f"could not publish {r.source_id} rank {r.rank} worker {r.worker}: it keeps changing",
                          "retry the publish")

    def remove(self, source_id: str, rank: int, worker: str) -> bool:
        return self._remove(source_id, rank, worker)

    def _verify_key(self, kind: str, source_id: str, rank: int, worker: str) -> str:
        wire.check_key(source_id, rank, worker)
        return f"{self.prefix}:{kind}:{source_id}:{rank}:{worker}"

    def request_verify(self, source_id: str, rank: int, worker: str) -> str:
        """Ask a live source to recompute its checksums (answered at its next heartbeat); returns the nonce."""
        nonce = secrets.token_hex(8)
        with self._io():
            self._db.delete(self._verify_key("verified", source_id, rank, worker))
            self._db.set(self._verify_key("verify", source_id, rank, worker), nonce, px=60_000)
        return nonce

    def verify_answer(self, source_id: str, rank: int, worker: str, nonce: str) -> Optional[dict]:
        with self._io():
            raw = self._db.get(self._verify_key("verified", source_id, rank, worker))
        data = wire.json_value(raw, 1 << 16)
        return data if isinstance(data, dict) and data.get("nonce") == nonce else None

    def _remove(self, source_id: str, rank: int, worker: str, *, expected: str = "", run_id: str = "") -> bool:
        with self._io():
            if not run_id:  # the heartbeat knows the run: drop the record from the run's set too
                beat = wire.beat_of(self._db.hget(f"{self.prefix}:beats:{source_id}:{rank}", worker))
                run_id = beat.run_id if beat is not None and valid_id(beat.run_id) else ""
            keys = self._keys(source_id, rank, worker, run_id)
            args = [worker, f"{source_id}:{rank}", expected, f"{source_id}:{rank}:{worker}" if run_id else ""]
            return bool(self._remove_script(keys=keys, args=args))

    def remove_run(self, run_id: str) -> int:
        if not valid_id(run_id):
            return 0
        run_key = f"{self.prefix}:run:{run_id}"
        removed = 0
        with self._io():
            members = [wire.as_text(m) for m in self._db.smembers(run_key)]
        for member in members:
            parts = (member or "").split(":")
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            sid, rank, worker = parts[0], int(parts[1]), parts[2]
            with self._io():
                raw = self._db.hget(f"{self.prefix}:peers:{sid}:{rank}", worker) if wire.safe_key(sid, rank, worker) else None
            record = wire.record_of(raw)
            if record is not None and record.run_id == run_id and (record.source_id, record.rank, record.worker) \
                    == (sid, rank, worker):
                removed += self._remove(sid, rank, worker, run_id=run_id)
            with self._io():
                self._db.srem(run_key, member)
        return removed

    def reap(self, grace_s: float = 60.0) -> int:
        """Remove records stale for longer than grace_s, unreadable ones whose heartbeat ended as long ago,
        fields and index entries that are not ours or point at nothing. Returns the records removed."""
        now, removed = time.time(), 0
        for sid, rank in self._index(drop_invalid=True):
            key = f"{self.prefix}:peers:{sid}:{rank}"
            with self._io():
                names = self._db.hkeys(key)
                bad = [n for n in names if not valid_id(wire.as_text(n))]
                if bad:
                    self._db.hdel(key, *bad)
            workers = [wire.as_text(n) for n in names if n not in bad]
            for worker, (got, owner) in self._load(sid, rank, [w for w in workers if w and valid_id(w)], now).items():
                if isinstance(got, PeerEntry):
                    gone = reapable(got, grace_s, now)
                else:  # unreadable (corrupt, or a newer schema): only its heartbeat says whether it is alive
                    gone = not got.live and (got.since is None or now - got.since > grace_s)
                if gone:  # only the record judged here: a fresh one published meanwhile has another owner
                    removed += self._remove(sid, rank, worker, expected=owner)
            p = self.prefix
            with self._io():
                self._prune_script(keys=[key, f"{p}:beats:{sid}:{rank}", f"{p}:owners:{sid}:{rank}", f"{p}:sources"],
                                   args=[f"{sid}:{rank}"])
        return removed

    # ---- reading ----

    def sources(self, source_id: str, rank: int | None = None, *, include_stale: bool = False) -> list[PeerEntry]:
        wire.check_key(source_id, 0 if rank is None else rank, "w")
        pairs = [(source_id, rank)] if rank is not None else [(s, k) for s, k in self._index() if s == source_id]
        return self._collect(pairs, include_stale)

    def all_sources(self, *, include_stale: bool = True) -> list[PeerEntry]:
        return self._collect(self._index(), include_stale)

    # ---- internals ----

    def _index(self, drop_invalid: bool = False) -> list[tuple[str, int]]:
        """(source id, rank) of every records hash; members that are not such a pair are skipped (or dropped)."""
        with self._io():
            members = self._db.smembers(f"{self.prefix}:sources")
        pairs, bad = [], []
        for m in members:
            sid, _, rank = (wire.as_text(m) or "").rpartition(":")
            if rank.isdigit() and len(rank) < 10 and valid_id(sid):
                pairs.append((sid, int(rank)))
            else:
                bad.append(m)
        if drop_invalid and bad:
            with self._io():
                self._db.srem(f"{self.prefix}:sources", *bad)
        return sorted(pairs)

    def _collect(self, pairs: list[tuple[str, int]], include_stale: bool) -> list[PeerEntry]:
        now = time.time()
        entries = []
        for sid, rank in pairs:
            with self._io():
                workers = [wire.as_text(w) for w in self._db.hkeys(f"{self.prefix}:peers:{sid}:{rank}")]
            for got, _ in self._load(sid, rank, [w for w in workers if w and valid_id(w)], now).values():
                if isinstance(got, PeerEntry) and (include_stale or got.state != STALE):
                    entries.append(got)
        return ordered(entries)

    def _load(self, sid: str, rank: int, workers: list[str], now: float) -> dict[str, tuple[PeerEntry | _Unreadable, str]]:
        """worker → (its entry, or `_Unreadable` for a value that is not a valid record; its owner token, "" if none).
        Workers without a record are left out."""
        if not workers:
            return {}
        keys = self._keys(sid, rank, workers[0])
        with self._io():
            pipe = self._db.pipeline(transaction=False)
            pipe.hmget(keys[0], workers)
            pipe.hmget(keys[1], workers)
            pipe.hmget(keys[5], workers)
            for w in workers:
                pipe.exists(f"{self.prefix}:beat:{sid}:{rank}:{w}")
            raws, beats, owners, *alive = pipe.execute()
        out: dict[str, tuple[PeerEntry | _Unreadable, str]] = {}
        for worker, raw, beat_raw, owner, live in zip(workers, raws, beats, owners, alive):
            if raw is None:
                continue
            record, beat = wire.record_of(raw), wire.beat_of(beat_raw)
            if record is None or (record.source_id, record.rank, record.worker) != (sid, rank, worker):
                got: PeerEntry | _Unreadable = _Unreadable(bool(live), beat.at + beat.ttl_s if beat else None)
            else:
                got = judge(record, beat, host=self.host, boot=self._boot_id, now=now, beat_expired=not live)
            out[worker] = (got, wire.as_text(owner) or "")
        return out


class _Unreadable(NamedTuple):
    """A stored value that is not a valid record: its heartbeat key says if it is alive, its last beat since when not."""

    live: bool
    since: Optional[float]


