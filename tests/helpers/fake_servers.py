"""Small local HTTP servers that speak engine-shaped JSON, for unit tests without an engine.

FakeEngine(api="sglang") answers like SGLang: /health, /v1/models (owned_by "sglang"), /model_info,
/server_info, /generate (meta_info.input_token_logprobs / output_token_logprobs as [logprob, id, text];
"text" or "input_ids") and streaming /v1/completions. FakeEngine(api="vllm") answers /version, /v1/models
and non-streaming /v1/completions with prompt_logprobs (a text or token-id prompt) like vLLM 0.32.
With `tokenize=True` both answer /tokenize and /detokenize (default: 404, as older servers); both
enforce `max_model_len` as the engines do: SGLang 0.5.23 refuses an input of context - 6 tokens or more and cuts
max_new_tokens to context - input - 2; vLLM 0.32 refuses a prompt that does not fit and cuts max_tokens to what is left.
The token ids and logprobs come from a deterministic toy "model" (a function of the ids), so a test
can record gold from one FakeEngine and compare against another with different `perturb` settings.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def toy_tokenize(text: str) -> list[int]:
    """BOS (0) + one id per UTF-8 byte (+4): ids are stable and every text has a tokenization."""
    return [0] + [b + 4 for b in text.encode("utf-8")]


def toy_logprob(prefix: list[int], token: int) -> float:
    """A deterministic, prefix-dependent logprob in (-12, -0.1)."""
    h = (sum((i + 1) * t for i, t in enumerate(prefix[-8:])) * 2654435761 + token * 40503) % 1000003
    return -0.1 - 11.9 * (h / 1000003)


def toy_detokenize(ids: list[int]) -> str:
    return bytes(t - 4 for t in ids if 4 <= t < 260).decode("utf-8", errors="replace")


def toy_next(prefix: list[int]) -> int:
    return 4 + (sum(prefix[-4:]) * 31 + len(prefix)) % 256


class FakeEngine:
    """A threaded HTTP server on 127.0.0.1; use as a context manager. `.requests` records bodies."""

    def __init__(self, api: str = "sglang", model: str = "toy-model", version: str = "0.5.23",
                 perturb_logprob: float = 0.0, perturb_token_at: int | None = None,
                 health_status: int = 200, token_delay_s: float = 0.0, first_token_delay_s: float = 0.0,
                 fail_generate: bool = False, fail_completions_every: int = 0, max_model_len: int = 4096,
                 tokenize: bool = False, health_ready_after: int | None = None) -> None:
        self.api = api
        self.model = model
        self.version = version
        self.perturb_logprob = perturb_logprob
        self.perturb_token_at = perturb_token_at
        self.health_status = health_status
        self.health_ready_after = health_ready_after  # /health answers 200 after this many answers of health_status
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.fail_generate = fail_generate
        self.fail_completions_every = fail_completions_every  # every k-th completion answers 500
        self.max_model_len = max_model_len
        self.tokenize = tokenize
        self._completions = 0
        self.requests: list[tuple[str, str, Any]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ the toy model
    def continue_ids(self, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
        seq = list(prompt_ids)
        ids, lps = [], []
        for k in range(n):
            t = toy_next(seq)
            if self.perturb_token_at is not None and k == self.perturb_token_at:
                t = 4 + (t + 1) % 256
            lp = toy_logprob(seq, t) + self.perturb_logprob
            ids.append(t)
            lps.append(lp)
            seq.append(t)
        return ids, lps

    def prompt_lps(self, prompt_ids: list[int]) -> list[float | None]:
        return [None] + [toy_logprob(prompt_ids[:i], prompt_ids[i]) + self.perturb_logprob
                         for i in range(1, len(prompt_ids))]

    # ------------------------------------------------------------ HTTP
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeEngine":
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _json(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                engine.requests.append(("GET", self.path, None))
                if self.path == "/health":
                    asked = sum(1 for _, path, _ in engine.requests if path == "/health")
                    if engine.health_status == 200 or (engine.health_ready_after is not None
                                                        and asked > engine.health_ready_after):
                        self.send_response(200)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                    else:
                        self._json(engine.health_status, {"error": "starting"})
                elif self.path == "/v1/models":
                    owned = "sglang" if engine.api == "sglang" else engine.api
                    self._json(200, {"object": "list", "data": [
                        {"id": engine.model, "object": "model", "owned_by": owned, "root": engine.model,
                         "max_model_len": engine.max_model_len}]})
                elif self.path == "/model_info" and engine.api == "sglang":
                    self._json(200, {"model_path": engine.model, "tokenizer_path": engine.model,
                                     "is_generation": True})
                elif self.path == "/server_info" and engine.api == "sglang":
                    self._json(200, {"version": engine.version, "tp_size": 1, "dtype": "float32"})
                elif self.path == "/version" and engine.api == "vllm":
                    self._json(200, {"version": engine.version})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                engine.requests.append(("POST", self.path, body))
                if self.path in ("/tokenize", "/detokenize") and engine.tokenize:
                    if self.path == "/tokenize":
                        ids = toy_tokenize(body["prompt"])
                        self._json(200, {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})
                    else:
                        key = "prompt" if engine.api == "vllm" else "text"
                        self._json(200, {key: toy_detokenize(body["tokens"])})
                elif self.path == "/v1/completions" and engine.api == "vllm" and not body.get("stream"):
                    self._vllm_completion(body)
                elif self.path == "/generate" and engine.api == "sglang":
                    if engine.fail_generate:
                        self._json(400, {"error": {"message": "The input is too long."}})
                        return
                    sp = body.get("sampling_params", {})
                    pids = list(body["input_ids"]) if "input_ids" in body else toy_tokenize(body["text"])
                    max_req_len = engine.max_model_len - 1  # SGLang 0.5.23 tp_worker.py:568-572, scheduler.py:2714
                    if len(pids) >= max_req_len - 5:
                        self._json(400, {"error": {"message": f"The input ({len(pids)} tokens) is longer than the "
                                                              f"model's context length ({engine.max_model_len} tokens)."}})
                        return
                    n_new = min(int(sp.get("max_new_tokens", 16)), max_req_len - len(pids) - 1)
                    oids, olps = engine.continue_ids(pids, n_new)
                    plps = engine.prompt_lps(pids)
                    self._json(200, {
                        "text": "".join(chr(max(32, t - 4)) for t in oids),
                        "meta_info": {
                            "id": "req-1",
                            "prompt_tokens": len(pids),
                            "completion_tokens": len(oids),
                            "finish_reason": {"type": "length", "length": len(oids)},
                            "input_token_logprobs": [[lp, t, None] for lp, t in zip(plps, pids)],
                            "output_token_logprobs": [[lp, t, None] for lp, t in zip(olps, oids)],
                        },
                    })
                elif self.path == "/v1/completions" and body.get("stream"):
                    engine._completions += 1
                    k = engine.fail_completions_every
                    if k and engine._completions % k == 0:
                        self._json(500, {"error": {"message": "engine hiccup", "code": 500}})
                        return
                    self._stream(body)
                else:
                    self._json(404, {"detail": "Not Found"})

            def _vllm_completion(self, body: dict) -> None:
                prompt = body["prompt"]
                pids = list(prompt) if isinstance(prompt, list) else toy_tokenize(prompt)
                if len(pids) > engine.max_model_len - 1:
                    self._json(400, {"error": {"message": f"This model's maximum context length is "
                                                          f"{engine.max_model_len} tokens.", "code": 400}})
                    return
                n = min(int(body.get("max_tokens", 16)), engine.max_model_len - len(pids))  # vLLM 0.32 shortens
                oids, olps = engine.continue_ids(pids, n)
                plps = engine.prompt_lps(pids)
                self._json(200, {"choices": [{
                    "index": 0, "text": toy_detokenize(oids), "finish_reason": "length", "token_ids": oids,
                    "prompt_token_ids": pids,
                    "prompt_logprobs": [None if lp is None else {str(t): {"logprob": lp}} for t, lp in zip(pids, plps)],
                    "logprobs": {"token_logprobs": olps, "tokens": [f"token_id:{t}" for t in oids]},
                }]})

            def _stream(self, body: dict) -> None:
                n = int(body.get("max_tokens", 16))
                prompt = body.get("prompt")
                n_prompt = len(prompt) if isinstance(prompt, list) else len(toy_tokenize(str(prompt)))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(obj: Any) -> None:
                    data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                time.sleep(engine.first_token_delay_s)
                for k in range(n):
                    if k:
                        time.sleep(engine.token_delay_s)
                    chunk({"id": "cmpl-1", "object": "text_completion", "model": engine.model,
                           "choices": [{"index": 0, "text": "x", "finish_reason": "length" if k == n - 1 else None}]})
                if (body.get("stream_options") or {}).get("include_usage"):
                    chunk({"id": "cmpl-1", "object": "text_completion", "model": engine.model, "choices": [],
                           "usage": {"prompt_tokens": n_prompt, "completion_tokens": n,
                                     "total_tokens": n_prompt + n}})
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        class Server(ThreadingHTTPServer):
            block_on_close = False  # do not join handler threads of idle keep-alive connections
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients that hang up early (timeouts under test) are expected

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
