"""One byte range of a URL read straight into memory-mapped file pages: the socket's bytes land where the file
keeps them (`readinto`, the GIL released while the kernel copies), with no Python-level buffer between.

Why: the S3 staging path is CPU-bound in the client, not in the server. On the 2-core VM against a local
SeaweedFS, httpx's streaming (a bytes object per read, then `pwrite`) staged 1 GiB at 0.28–0.38 GiB/s while
the same 16 connections reading into an mmap with the standard library's http.client reached 0.69–0.79 GiB/s
(scripts/bench/bench_s3_stage.py, docs/benchmarks.md). Used for presigned S3 URLs (no redirects, no auth header,
plain HTTP(S)); a URL a proxy variable applies to stays on httpx, which honours proxies. Each chunk's pages are
allocated with `posix_fallocate` before they are written, so a full filesystem is ENOSPC there, never a
SIGBUS from a page the mapping could not get.
"""

from __future__ import annotations

import http.client
import os
import ssl
import urllib.request
from typing import Callable
from urllib.parse import urlsplit

TIMEOUT_S = 30.0
Conns = dict  # (scheme, host, port) → an open http.client connection, one dict per worker thread


def usable(url: str) -> bool:
    """http or https, and no proxy variable that applies to its host (http.client does not do proxies)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    return not (proxies.get(parts.scheme) or proxies.get("all")) or bool(urllib.request.proxy_bypass(parts.hostname))


def _connection(conns: Conns, url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    key = (parts.scheme, parts.hostname, parts.port)
    conn = conns.get(key)
    if conn is None:
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=TIMEOUT_S,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)
        conns[key] = conn
    return conn


def drop(conns: Conns, url: str) -> None:
    """Forget (and close) the connection `url` went over: after an error it may be mid-response."""
    parts = urlsplit(url)
    conn = conns.pop((parts.scheme, parts.hostname, parts.port), None)
    if conn is not None:
        conn.close()


def close_all(conns: Conns) -> None:
    for conn in conns.values():
        conn.close()
    conns.clear()


class Refused(Exception):
    """The server answered, but not with the bytes asked for: `status` (and whether the range was ignored)."""

    def __init__(self, status: int, ignored_range: bool) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.ignored_range = status, ignored_range


def read_range(conns: Conns, url: str, start: int, view: memoryview, fd: int, ranged: bool,
               progress: Callable[[int], None], cancelled: Callable[[], bool]) -> int:
    """GET bytes [start, start + len(view)) of `url` into `view` (the file's mapping from `start` on); returns
    the bytes read. Raises Refused, InterruptedError once `cancelled()` (asked between reads), or OSError /
    http.client.HTTPException (the caller retries on a new connection)."""
    want = len(view)
    if want:
        os.posix_fallocate(fd, start, want)  # a full filesystem fails here, not as a SIGBUS in the copy
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    conn = _connection(conns, url)
    conn.request("GET", target, headers={"Range": f"bytes={start}-{start + want - 1}"} if ranged else {})
    resp = conn.getresponse()
    if resp.status >= 400 or (ranged and resp.status != 206):
        resp.read()
        raise Refused(resp.status, ranged and resp.status < 400)
    got = 0
    while got < want:
        if cancelled():
            raise InterruptedError("cancelled")
        n = resp.readinto(view[got:min(want, got + (4 << 20))])
        if not n:
            raise http.client.IncompleteRead(b"", want - got)
        got += n
        progress(n)
    extra = resp.read()  # a server that sends past the range: not written; the connection stays usable
    del extra
    return got
