"""Load generator for OpenAI-compatible servers (vLLM, SGLang): streaming /v1/completions.

Per request: time to first token (TTFT), inter-token latencies (ITL: gaps between content chunks),
end-to-end latency; per concurrency level: p50/p90/p99 of each, output tokens/s, requests/s, errors.
One warm-up request first (not counted). Errors are counted, never fatal. A run is bounded by the number
of requests and by --max-duration (requests still running then are cancelled and counted as errors).

The hot path is a lean HTTP/1.1 client on an asyncio Protocol (one keep-alive connection per in-flight
request; TTFT counts from sending the request, connection set-up excluded); timestamps are
time.perf_counter() taken in data_received(), as the bytes arrive. scripts/bench_client.py measures the
client's own overhead against a trivial local streaming server.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from mxlaunch.errors import UsageError
from mxlaunch.http import ServerInfo, describe_exc, probe
from mxlaunch.prompts import BUILTIN_PROMPTS, load_prompts

MAX_ERROR_SAMPLES = 5


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


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "mean": (sum(ms) / len(ms)) if ms else None,
        "n": len(ms),
    }


# ---------------------------------------------------------------- the client's hot path
#
# A lean HTTP/1.1 client on an asyncio Protocol: requests are serialized before the clock starts, each
# worker keeps one keep-alive connection (TCP_NODELAY), chunked transfer and SSE are decoded by hand,
# and every timestamp is taken in data_received() — as the bytes arrive, before any parsing — so the
# client's own work does not inflate TTFT or ITL. httpx (used everywhere else) adds ~2 ms per request
# on a 2-core box: far over the 2 % budget that scripts/bench_client.py enforces.


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


class _Conn:
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


async def timed_request(conn: _Conn, request: bytes, timeout: float) -> RequestResult:
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
    conns: list[_Conn] = []

    async def worker() -> None:
        conn = _Conn(target)
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


def summarize(results: list[RequestResult], duration: float, concurrency: int, cpu_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    samples: list[str] = []
    for r in errors:
        if r.error and r.error not in samples:
            samples.append(r.error)
        if len(samples) >= MAX_ERROR_SAMPLES:
            break
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": samples,
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "output_tokens_per_request": {
            "min": min((r.output_tokens for r in ok), default=None),
            "max": max((r.output_tokens for r in ok), default=None),
        },
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": stats_ms([r.e2e for r in ok if r.e2e is not None]),
        # The client's own CPU time over the level; a share near 1.0 means the client is the bottleneck.
        "client_cpu_s": cpu_s,
        "client_cpu_share": (cpu_s / duration) if cpu_s is not None and duration > 0 else None,
    }


# ---------------------------------------------------------------- prompts


def _tokenize(info: ServerInfo, text: str, timeout: float) -> list[int] | None:
    """Token ids from the server's own tokenizer (vLLM: /tokenize), or None if it has none."""
    try:
        with httpx.Client(timeout=timeout) as client:
            resp = client.post(
                f"{info.url}/tokenize", json={"model": info.model, "prompt": text, "add_special_tokens": False}
            )
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        tokens = resp.json().get("tokens")
    except (ValueError, AttributeError):
        return None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
        return None
    return tokens


def make_prompts(
    info: ServerInfo, dataset: str, n: int, input_len: int, seed: int, timeout: float
) -> tuple[list[Any], dict[str, Any]]:
    """n prompts. 'random': windows of exactly input_len token ids taken at random offsets from the
    server-tokenized built-in text (exact lengths, no shared prefixes); a server without /tokenize gets
    text of input_len random words instead. Otherwise a prompts file (see mxlaunch.prompts), cycled."""
    rng = random.Random(seed)
    if dataset != "random":
        items = [p["text"] for p in load_prompts(Path(dataset))]
        return [items[i % len(items)] for i in range(n)], {"dataset": dataset, "input_len_exact": False}
    corpus_text = "\n\n".join(p["text"] for p in BUILTIN_PROMPTS)
    ids = _tokenize(info, corpus_text, timeout)
    if ids:
        while len(ids) < 2 * input_len:
            ids = ids + ids
        out = []
        for _ in range(n):
            start = rng.randrange(0, len(ids) - input_len)
            out.append(ids[start : start + input_len])
        return out, {"dataset": "random", "input_len_exact": True}
    words = corpus_text.split()
    out = [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(n)]
    return out, {"dataset": "random", "input_len_exact": False}


def payload_for(model: str, prompt: Any, output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# ---------------------------------------------------------------- the run


def parse_sweep(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise UsageError(f"--sweep {text!r} is not a list of positive integers", "pass e.g. --sweep 1,4,16")
    return levels


def _run(coro: Any) -> Any:
    """uvloop when it is there (vLLM and SGLang both install it): a cheaper event loop, less overhead."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_bench(
    url: str,
    requests: int = 32,
    concurrencies: list[int] | None = None,
    input_len: int = 128,
    output_len: int = 64,
    dataset: str = "random",
    wait_s: float = 0.0,
    timeout: float = 60.0,
    max_duration: float = 600.0,
    seed: int = 0,
    model: str | None = None,
    warmup: bool = True,
    on_level: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    concurrencies = concurrencies or [1]
    for name, value in (("--requests", requests), ("--input-len", input_len), ("--output-len", output_len)):
        if value < 1:
            raise UsageError(f"{name} {value} must be ≥ 1", f"pass a positive {name}")
    if any(c < 1 for c in concurrencies):
        raise UsageError("--concurrency must be ≥ 1", "pass e.g. --concurrency 4")
    if timeout <= 0 or max_duration <= 0:
        raise UsageError("--timeout and --max-duration must be > 0", "pass a number of seconds")
    if dataset != "random" and not Path(dataset).is_file():
        raise UsageError(f"--dataset {dataset!r} is neither 'random' nor a readable file", "pass random or a file")
    info = probe(url, wait_s)
    model_name = model or info.model
    prompts, ds_info = make_prompts(info, dataset, requests * len(concurrencies) + 1, input_len, seed, timeout)
    target = Target(info.url)
    started = time.monotonic()
    deadline = started + max_duration

    async def main() -> tuple[dict | None, list[dict]]:
        warm = None
        if warmup:
            conn = _Conn(target)
            warm_req = target.request_bytes(payload_for(model_name, prompts[-1], output_len))
            w = await timed_request(conn, warm_req, timeout)
            conn.close()
            warm = {"ok": w.ok, "error": w.error, "ttft_ms": None if w.ttft is None else w.ttft * 1000}
        levels = []
        for li, c in enumerate(concurrencies):
            if on_level:
                on_level(c)
            batch = prompts[li * requests : (li + 1) * requests]  # the warm-up used the extra last one
            reqs = [target.request_bytes(payload_for(model_name, p, output_len)) for p in batch]
            remaining = max(0.001, deadline - time.monotonic())
            results, duration, cpu = await run_level(target, reqs, c, remaining, timeout)
            levels.append(summarize(results, duration, c, cpu))
        return warm, levels

    warm, levels = _run(main())
    return {
        "url": info.url,
        "api": info.api,
        "model": model_name,
        "engine_version": info.engine_version,
        "requests_per_level": requests,
        "input_len": input_len,
        "output_len": output_len,
        **ds_info,
        "event_loop": event_loop_name(),
        "warmup": warm,
        "levels": levels,
        "errors": sum(lv["errors"] for lv in levels),
        "wall_s": time.monotonic() - started,
    }
