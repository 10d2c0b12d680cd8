"""A small HTTP helper shared by verify and bench: URL checks, readiness wait, API detection.

Engines speak two dialects here: vLLM (OpenAI API + vLLM extras such as ``prompt_logprobs`` and
``return_token_ids``) and SGLang (OpenAI API + its native ``/generate``). Which one a server speaks
is read from ``/v1/models`` (``owned_by``), then from engine-specific endpoints.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from mxlaunch.errors import UsageError

WAIT_FIX = "start the server or check --url; --wait SECONDS polls until it is up"


@dataclass
class ServerInfo:
    """What a server says about itself; stored in gold files and bench results."""

    url: str
    api: str  # "vllm" | "sglang" | "openai" (unknown OpenAI-compatible)
    model: str
    engine_version: str | None = None
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def base_url(url: str) -> str:
    """Normalise a user's --url: scheme://host:port[/prefix], no trailing slash or /v1."""
    text = (url or "").strip()
    if not text:
        raise UsageError("--url is empty", "pass the server's base URL, e.g. http://127.0.0.1:8000")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--url {url!r} is not an http(s) URL", "pass e.g. http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise UsageError(f"--url {url!r} has an invalid port", "pass e.g. http://127.0.0.1:8000") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def describe_exc(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


def error_message(resp: httpx.Response) -> str:
    """The server's own error message when it gives one (vLLM and SGLang both nest it under "error")."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("detail")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return f"HTTP {resp.status_code}: {str(err).splitlines()[0][:300]}"
    text = resp.text.strip().splitlines()[0][:300] if resp.text.strip() else resp.reason_phrase
    return f"HTTP {resp.status_code}: {text}"


def _get_json(client: httpx.Client, url: str) -> Any | None:
    try:
        resp = client.get(url)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


def wait_ready(url: str, wait_s: float, timeout: float = 10.0) -> tuple[str, dict]:
    """Poll until /health answers 200 and /v1/models lists a model; return (model id, its record).

    ``wait_s == 0`` makes one attempt. An unreachable or never-ready server is a UsageError (exit 2).
    """
    if wait_s < 0:
        raise UsageError(f"--wait {wait_s} is negative", "pass 0 (one attempt) or a number of seconds")
    deadline = time.monotonic() + wait_s
    last = "no answer"
    with httpx.Client(timeout=timeout) as client:
        while True:
            try:
                health = client.get(f"{url}/health")
                if health.status_code == 200:
                    models = client.get(f"{url}/v1/models")
                    if models.status_code == 200:
                        data = _models(models)
                        if data:
                            return str(data[0]["id"]), data[0]
                        last = "/v1/models lists no model"
                    else:
                        last = f"/v1/models answered {models.status_code}"
                elif health.status_code == 404:
                    # A web server, but not an inference server (or a wrong path prefix): no point waiting.
                    raise UsageError(
                        f"{url}/health answered 404: this is not an inference server's base URL",
                        "pass the base URL the engine listens on, e.g. http://127.0.0.1:8000",
                    )
                else:
                    last = f"/health answered {health.status_code}"
            except httpx.HTTPError as exc:
                last = describe_exc(exc)
            if time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
    waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
    if "Error" in last or "Timeout" in last:
        raise UsageError(f"cannot reach server at {url} ({last}){waited}", WAIT_FIX)
    raise UsageError(f"server at {url} is not ready ({last}){waited}", WAIT_FIX)


def _models(resp: httpx.Response) -> list[dict]:
    try:
        body = resp.json()
    except ValueError:
        return []
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [m for m in data if isinstance(m, dict) and m.get("id")]


def probe(url: str, wait_s: float = 0.0, timeout: float = 10.0) -> ServerInfo:
    """Wait for the server, then find out which API it speaks and what it serves."""
    url = base_url(url)
    model, record = wait_ready(url, wait_s, timeout)
    owned_by = str(record.get("owned_by", "")).lower()
    extra: dict[str, Any] = {"owned_by": record.get("owned_by"), "root": record.get("root")}
    with httpx.Client(timeout=timeout) as client:
        api = "vllm" if owned_by == "vllm" else "sglang" if owned_by == "sglang" else ""
        model_info = None
        if api in ("", "sglang"):
            model_info = _get_json(client, f"{url}/model_info") or _get_json(client, f"{url}/get_model_info")
            if isinstance(model_info, dict) and "model_path" in model_info:
                api = "sglang"
        version = None
        if api == "sglang":
            server_info = _get_json(client, f"{url}/server_info") or _get_json(client, f"{url}/get_server_info")
            if isinstance(server_info, dict):
                version = server_info.get("version")
                for key in ("tp_size", "dtype", "load_format", "context_length"):
                    if key in server_info:
                        extra[key] = server_info[key]
            if isinstance(model_info, dict):
                extra["model_path"] = model_info.get("model_path")
                extra["tokenizer_path"] = model_info.get("tokenizer_path")
        else:
            ver = _get_json(client, f"{url}/version")
            if isinstance(ver, dict) and "version" in ver:
                version = ver.get("version")
                api = api or "vllm"
        api = api or "openai"
    max_len = record.get("max_model_len")
    return ServerInfo(
        url=url,
        api=api,
        model=model,
        engine_version=str(version) if version is not None else None,
        max_model_len=int(max_len) if isinstance(max_len, int) else None,
        extra={k: v for k, v in extra.items() if v is not None},
    )
