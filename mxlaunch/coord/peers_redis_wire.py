"""The Redis side of the P2P registry (coord/peers_redis.py): the Lua scripts that make publish, heartbeat,
remove and prune each one atomic step on the server, who may connect (`check_auth`), the key-part check, and
decoding what the server holds back into records and beats. Apart from the registry's operations so that
what runs on (and comes from) the server is read in one place; `redis` itself is imported only by
`import_redis`, when a redis:// registry is opened."""

from __future__ import annotations

import json
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

from mxlaunch import settings
from mxlaunch.coord.base import valid_id
from mxlaunch.coord.peers_record import MAX_BEAT_BYTES, MAX_RECORD_BYTES, Beat, SourceRecord, redact_url
from mxlaunch.errors import UsageError

# KEYS (all three scripts; RedisRegistry._keys): record hash, beats hash, beat key, sources set, run set, owners hash
# ARGV: worker, record JSON, beat JSON, ttl ms, sources member, run member, token
PUBLISH = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[6], ARGV[1], ARGV[7])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('SADD', KEYS[5], ARGV[6])
return 1
"""
# ARGV: worker, beat JSON, ttl ms, token
BEAT = """
if redis.call('HGET', KEYS[6], ARGV[1]) ~= ARGV[4] or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
return 1
"""
# ARGV: worker, sources member, expected token ('' = any), run member ('' = none)
REMOVE = """
local cur = redis.call('HEXISTS', KEYS[1], ARGV[1])
if ARGV[3] ~= '' and redis.call('HGET', KEYS[6], ARGV[1]) ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('DEL', KEYS[3])
if ARGV[4] ~= '' then redis.call('SREM', KEYS[5], ARGV[4]) end
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[4], ARGV[2]) end
return cur
"""
# KEYS: record hash, beats hash, owners hash, sources set; ARGV: sources member. A source/rank with no records
# left leaves the index in the same step (a publish in between would otherwise be dropped from it).
PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3])
return redis.call('SREM', KEYS[4], ARGV[1])
"""



def import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise UsageError("a redis:// registry needs the redis Python package, which is not installed",
                         "pip install 'mxlaunch[redis]'") from exc
    return redis


def check_auth(url: str) -> Optional[str]:
    """The password to add to the connection (MXLAUNCH_REDIS_PASSWORD when the URL has none), or None.
    Raises UsageError for a URL without any password unless MXLAUNCH_REDIS_TRUSTED=1."""
    parts = urlsplit(url)
    if parts.password or parse_qs(parts.query).get("password"):
        return None
    password = settings.redis_password()
    if password:
        return password
    if settings.redis_trusted():
        return None
    raise UsageError(f"the peer registry {redact_url(url)} has no password: anyone who reaches that server could "
                     "read the P2P records (and so the sources' memory) and forge records targets trust",
                     f"use redis://:PASSWORD@host:port/db (requirepass), set {settings.REDIS_PASSWORD}, or set "
                     f"{settings.REDIS_TRUSTED}=1 on a network no one else reaches")


def ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def safe_key(source_id: str, rank: int, worker: str) -> bool:
    return valid_id(source_id) and valid_id(worker) and isinstance(rank, int) and not isinstance(rank, bool) \
        and 0 <= rank < 10**9


def check_key(source_id: str, rank: int, worker: str) -> None:
    if not safe_key(source_id, rank, worker):
        raise UsageError(f"source {source_id!r} rank {rank!r} worker {worker!r} is not a valid key",
                         "use ids of letters, digits, . _ - and a rank ≥ 0")


def as_text(raw: Optional[bytes]) -> Optional[str]:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        return None


def json_value(raw: Optional[bytes], limit: int) -> Any:
    text = as_text(raw)
    if text is None or len(text) > limit:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def record_of(raw: Optional[bytes]) -> Optional[SourceRecord]:
    return SourceRecord.from_json(json_value(raw, MAX_RECORD_BYTES))


def beat_of(raw: Optional[bytes]) -> Optional[Beat]:
    return Beat.from_json(json_value(raw, MAX_BEAT_BYTES))
