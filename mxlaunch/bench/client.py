"""The load generator's HTTP client: a lean HTTP/1.1 client on an asyncio Protocol (mxlaunch/bench/run.py runs it).

One keep-alive connection per in-flight request; TTFT counts from sending the request, connection
set-up excluded; timestamps are time.perf_counter() taken in data_received(), as the bytes arrive.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


from mxlaunch.http import describe_exc

@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None  # seconds
    itls: list[float] = field(default_factory=list)  # seconds
    e2e: float | None = None  # seconds
    output_tokens: int = 0
    chunks: int = 0
    prompt_tokens: int | None = None
    error: str | None = None


# ---------------------------------------------------------------- the client's hot path
#
# A lean HTTP/1.1 client on an asyncio Protocol: requests are serialized before the clock starts, each
# worker keeps one keep-alive connection (TCP_NODELAY), chunked transfer and SSE are decoded by hand,
# and every timestamp is taken in data_received() — as the bytes arrive, before any parsing — so the
# client's own work does not inflate TTFT or ITL. httpx (used everywhere else) adds ~2 ms per request
# on a 2-core box: far over the 2 % budget that scripts/bench/bench_client.py enforces.


def _http_error(status: int, body: bytes) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj.get("message", obj.get("detail"))) if isinstance(obj, dict) else None
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return f"HTTP {status}: {str(err).splitlines()[0][:300]}"
    except ValueError:
        pass
    text = body.decode("utf-8", "replace").strip()
    return f"HTTP {status}: {text.splitlines()[0][:300]}" if text else f"HTTP {status}"


class _Response:
    """Incremental parser of one HTTP/1.1 response carrying an SSE stream of completion chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future = loop.create_future()
        self.buf = b""
        self.state = "head"
        self.status = 0
        self.keep_alive = True
        self.need = 0
        self.sse = b""
        self.err_body = b""
        self.received = False
        self.t0 = 0.0
        self.first: float | None = None
        self.last = 0.0
        self.itls: list[float] = []
        self.chunks = 0
        self.usage: dict | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        self.received = True
        self.buf += data
        try:
            self._parse(now)
        except (ValueError, IndexError) as exc:
            self.keep_alive = False
            self.finish(f"bad HTTP response: {describe_exc(exc)}", now)

    def _parse(self, now: float) -> None:
        if self.state == "head":
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            lines = self.buf[:i].decode("latin-1").split("\r\n")
            self.buf = self.buf[i + 4 :]
            self.status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip().lower()
            self.keep_alive = headers.get("connection") != "close"
            if headers.get("transfer-encoding") == "chunked":
                self.state = "size"
            elif "content-length" in headers:
                self.state, self.need = "length", int(headers["content-length"])
            else:
                self.state, self.keep_alive = "eof", False
        while not self.future.done():
            if self.state == "size":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    return
                size = int(self.buf[:i].split(b";")[0], 16)
                self.buf = self.buf[i + 2 :]
                self.state, self.need = ("trailer", 0) if size == 0 else ("data", size)
            elif self.state == "data":
                if len(self.buf) < self.need + 2:
                    return
                self._body(self.buf[: self.need], now)
                self.buf = self.buf[self.need + 2 :]
                self.state = "size"
            elif self.state == "trailer":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    return
                self.buf = self.buf[i + 2 :]
                if i == 0:
                    self.finish(None, now)
            elif self.state == "length":
                take = self.buf[: self.need]
                self.buf = self.buf[len(take) :]
                self.need -= len(take)
                if take:
                    self._body(take, now)
                if self.need == 0:
                    self.finish(None, now)
                return
            else:  # "eof": the body runs until the server closes
                if self.buf:
                    self._body(self.buf, now)
                    self.buf = b""
                return

    def _body(self, data: bytes, now: float) -> None:
        if self.status != 200:
            self.err_body += data
            return
        self.sse += data
        while b"\n\n" in self.sse:
            event, self.sse = self.sse.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    continue
                try:
                    obj = json.loads(payload)
                except ValueError:
                    self.error = self.error or f"bad SSE data: {payload[:120]!r}"
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj and not obj.get("choices"):
                    err = obj["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    self.error = self.error or f"stream error: {str(msg)[:200]}"
                    continue
                if obj.get("choices"):
                    self.chunks += 1
                    if self.first is None:
                        self.first = now
                    else:
                        self.itls.append(now - self.last)
                    self.last = now
                if obj.get("usage"):
                    self.usage = obj["usage"]

    def finish(self, error: str | None, now: float) -> None:
        if self.future.done():
            return
        if error is None and self.status != 200:
            error = _http_error(self.status, self.err_body)
        error = error or self.error
        if error is None and self.first is None:
            error = "the stream ended without a token"
        if error is None and not self.done and self.usage is None:
            error = "the stream ended early (no [DONE])"
        if error is not None:
            self.future.set_result(RequestResult(ok=False, error=error))
            return
        usage = self.usage or {}
        self.future.set_result(
            RequestResult(
                ok=True, ttft=self.first - self.t0, itls=self.itls, e2e=now - self.t0,  # type: ignore[operator]
                output_tokens=int(usage.get("completion_tokens", self.chunks)), chunks=self.chunks,
                prompt_tokens=usage.get("prompt_tokens"),
            )
        )

    def lost(self, exc: BaseException | None, now: float) -> None:
        if self.state == "eof" and exc is None:
            self.finish(None, now)
        else:
            self.finish("connection closed by the server mid-response" + (f" ({describe_exc(exc)})" if exc else ""), now)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # first thing: the arrival time
        if self.response is not None:
            self.response.feed(data, now)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.lost(exc, time.perf_counter())


class Target:
    """Where the completions go: parsed once, request bytes built before the clock starts."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.use_ssl = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.use_ssl else 80)
        self.path = parts.path.rstrip("/") + "/v1/completions"
        self.netloc = parts.netloc

    def request_bytes(self, payload: dict[str, Any]) -> bytes:
        body = json.dumps(payload).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nUser-Agent: mxlaunch-bench\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


class Conn:
    """One keep-alive connection, one request at a time."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.proto: _Protocol | None = None

    async def _ensure(self) -> tuple[_Protocol, bool]:
        if self.proto is not None and not self.proto.closed:
            return self.proto, True
        loop = asyncio.get_running_loop()
        ctx = ssl.create_default_context() if self.target.use_ssl else None
        _, proto = await loop.create_connection(_Protocol, self.target.host, self.target.port, ssl=ctx)
        self.proto = proto
        return proto, False

    async def send(self, request: bytes) -> RequestResult:
        for attempt in (0, 1):
            proto, reused = await self._ensure()
            resp = _Response(asyncio.get_running_loop())
            proto.response = resp
            resp.t0 = time.perf_counter()
            proto.transport.write(request)  # type: ignore[union-attr]
            result: RequestResult = await resp.future
            proto.response = None
            if not resp.keep_alive or not result.ok:
                self.close()
            # A reused keep-alive connection the server had closed while idle: reconnect once.
            if attempt == 0 and reused and not resp.received and not result.ok:
                continue
            return result
        return result  # pragma: no cover

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        self.proto = None


async def timed_request(conn: Conn, request: bytes, timeout: float) -> RequestResult:
    try:
        return await asyncio.wait_for(conn.send(request), timeout)
    except asyncio.TimeoutError:
        conn.close()
        return RequestResult(ok=False, error=f"timed out after {timeout:g} s (--timeout)")
    except OSError as exc:
        conn.close()
        return RequestResult(ok=False, error=describe_exc(exc))


async def run_level(
    target: Target,
    requests: list[bytes],
    concurrency: int,
    time_limit: float,
    timeout: float,
) -> tuple[list[RequestResult], float, float]:
    """Run requests with at most `concurrency` in flight (one connection each); stop at time_limit
    (requests still running are cancelled and counted as errors)."""
    queue = list(reversed(requests))
    results: list[RequestResult] = []
    conns: list[Conn] = []

    async def worker() -> None:
        conn = Conn(target)
        conns.append(conn)
        while queue:
            request = queue.pop()
            results.append(await timed_request(conn, request, timeout))

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(requests)))]
    done, pending = await asyncio.wait(tasks, timeout=time_limit)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    for conn in conns:
        conn.close()
    for _ in range(len(requests) - len(results)):
        results.append(RequestResult(ok=False, error=f"not finished within --max-duration ({time_limit:.3g} s left)"))
    for t in done:
        if t.exception() is not None:  # a bug in the loop itself: surface it, do not hide it
            raise t.exception()  # type: ignore[misc]
    return results, duration, cpu
