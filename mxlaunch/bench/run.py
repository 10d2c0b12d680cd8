"""Load generator for OpenAI-compatible servers (vLLM, SGLang): streaming /v1/completions.

Per request: time to first token (TTFT), inter-token latencies (ITL: gaps between content chunks),
end-to-end latency; per concurrency level: p50/p90/p99 of each, output tokens/s, requests/s, errors.
One warm-up request first (not counted). Errors are counted, never fatal. A run is bounded by the number
of requests and by --max-duration (requests still running then are cancelled and counted as errors).

The hot path is a lean HTTP/1.1 client on an asyncio Protocol (mxlaunch/bench/client.py: one keep-alive
connection per in-flight request; TTFT counts from sending the request, connection set-up excluded;
timestamps are time.perf_counter() taken in data_received(), as the bytes arrive). scripts/bench/bench_client.py
measures the client's own overhead against a trivial local streaming server.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from mxlaunch.bench.client import Conn, RequestResult, Target, run_level, timed_request  # noqa: F401 — RequestResult: callers import it from here
from mxlaunch.errors import UsageError
from mxlaunch.http import ServerInfo, probe
from mxlaunch.verify.prompts import BUILTIN_PROMPTS, load_prompts

MAX_ERROR_SAMPLES = 5


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
    text of input_len random words instead. Otherwise a prompts file (see mxlaunch.verify.prompts), cycled."""
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
            conn = Conn(target)
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
