"""verify's server side: one prompt to a vLLM or SGLang server, its answer back as `Scored`.

Why its own module: the two engines' request/answer dialects (vLLM ``/v1/completions``, SGLang
``/generate``, and both engines' ``/tokenize`` and ``/detokenize``) are the only part of verify that speaks
HTTP; record, fit and compare work on `Scored` values and never see a request body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from mxlaunch.errors import UsageError
from mxlaunch.http import ServerInfo, describe_exc, error_message


class ServerRequestError(Exception):
    """The server answered a scoring request with an error (HTTP status or an unusable body)."""


class ServerGone(Exception):
    """The connection failed mid-run (server died, network)."""


@dataclass
class Scored:
    prompt_ids: list[int]
    prompt_logprobs: list[float | None]
    output_ids: list[int]
    output_logprobs: list[float | None]
    output_text: str
    finish_reason: str | None


# ---------------------------------------------------------------- engine dialects


def vllm_request(model: str, text: str | list[int], max_tokens: int) -> dict[str, Any]:
    """`text` may be token ids (a cut prompt): vLLM takes a list of ints as the prompt as it is."""
    return {
        "model": model,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,  # the chosen token's logprob only
        "prompt_logprobs": 0,  # each prompt token's own logprob only
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        "skip_special_tokens": False,
    }


def vllm_parse(body: Any) -> Scored:
    try:
        choice = body["choices"][0]
        prompt_ids = [int(i) for i in choice["prompt_token_ids"]]
        plp_raw = choice["prompt_logprobs"]
        lp = choice.get("logprobs") or {}
        out_lps = [None if v is None else float(v) for v in lp.get("token_logprobs", [])]
        if choice.get("token_ids") is not None:
            out_ids = [int(i) for i in choice["token_ids"]]
        else:  # older servers: "token_id:N" strings from return_tokens_as_token_ids
            out_ids = [int(str(t).split(":", 1)[1]) for t in lp.get("tokens", [])]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerRequestError(f"unexpected /v1/completions answer ({describe_exc(exc)})") from None
    if not isinstance(plp_raw, list) or len(plp_raw) != len(prompt_ids):
        raise ServerRequestError("the server returned no prompt_logprobs (is this vLLM?)")
    prompt_lps: list[float | None] = []
    for pos, (tid, entry) in enumerate(zip(prompt_ids, plp_raw)):
        if entry is None:
            prompt_lps.append(None)
            continue
        rec = entry.get(str(tid), entry.get(tid)) if isinstance(entry, dict) else None
        if not isinstance(rec, dict) or "logprob" not in rec:
            raise ServerRequestError(f"prompt_logprobs[{pos}] has no entry for prompt token {tid}")
        prompt_lps.append(float(rec["logprob"]))
    if len(out_lps) != len(out_ids):
        raise ServerRequestError(f"{len(out_ids)} output tokens but {len(out_lps)} logprobs")
    return Scored(prompt_ids, prompt_lps, out_ids, out_lps, str(choice.get("text", "")), choice.get("finish_reason"))


def sglang_request(text: str | list[int], max_tokens: int) -> dict[str, Any]:
    """`text` may be token ids (a cut prompt): SGLang takes them as `input_ids`."""
    return {
        ("input_ids" if isinstance(text, list) else "text"): text,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": max_tokens,
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "stream": False,
    }


def _sglang_rows(rows: Any, what: str) -> tuple[list[int], list[float | None]]:
    if not isinstance(rows, list):
        raise ServerRequestError(f"SGLang answer has no meta_info.{what}")
    ids: list[int] = []
    lps: list[float | None] = []
    for pos, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) < 2:
            raise ServerRequestError(f"meta_info.{what}[{pos}] is not [logprob, id, text]")
        lps.append(None if row[0] is None else float(row[0]))
        ids.append(int(row[1]))
    return ids, lps


def sglang_parse(body: Any) -> Scored:
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ServerRequestError("unexpected /generate answer (no meta_info)")
    meta = body["meta_info"]
    prompt_ids, prompt_lps = _sglang_rows(meta.get("input_token_logprobs"), "input_token_logprobs")
    out_ids, out_lps = _sglang_rows(meta.get("output_token_logprobs"), "output_token_logprobs")
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):
        finish = finish.get("type")
    return Scored(prompt_ids, prompt_lps, out_ids, out_lps, str(body.get("text", "")), finish)


class Scorer:
    """Sends one prompt to a server and returns what it scored, in the server's own dialect."""

    def __init__(self, info: ServerInfo, timeout: float) -> None:
        if info.api not in ("vllm", "sglang"):
            raise UsageError(
                f"server at {info.url} speaks neither vLLM's nor SGLang's API (owned_by="
                f"{info.extra.get('owned_by')!r}); verify needs prompt logprobs",
                "point --url at a vLLM or SGLang server",
            )
        self.info = info
        self.client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def score(self, text: str | list[int], max_tokens: int) -> Scored:
        """One prompt (text, or the token ids of a cut prompt) → what the server scored."""
        if self.info.api == "vllm":
            endpoint, payload, parse = "/v1/completions", vllm_request(self.info.model, text, max_tokens), vllm_parse
        else:
            endpoint, payload, parse = "/generate", sglang_request(text, max_tokens), sglang_parse
        return parse(self._post(endpoint, payload))

    def tokenize(self, text: str) -> list[int]:
        """The server's own tokenization of a prompt, special tokens (BOS) included as a request adds them."""
        body = self._post("/tokenize", {"model": self.info.model, "prompt": text, "add_special_tokens": True})
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ServerRequestError("unexpected /tokenize answer (no token list)")
        return tokens

    def detokenize(self, ids: list[int]) -> str:
        """Text of token ids (vLLM answers "prompt", SGLang "text"); only shown to people, never sent."""
        body = self._post("/detokenize", {"model": self.info.model, "tokens": ids})
        text = body.get("prompt", body.get("text")) if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ServerRequestError("unexpected /detokenize answer (no text)")
        return text

    def _post(self, endpoint: str, payload: dict[str, Any]) -> Any:
        try:
            resp = self.client.post(self.info.url + endpoint, json=payload)
        except httpx.HTTPError as exc:
            raise ServerGone(f"{self.info.url}{endpoint}: {describe_exc(exc)}") from None
        if resp.status_code != 200:
            raise ServerRequestError(error_message(resp))
        try:
            return resp.json()
        except ValueError:
            raise ServerRequestError(f"{endpoint} answered non-JSON") from None

