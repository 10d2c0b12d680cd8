"""Record and compare prompt logprobs and greedy continuations: "does this server serve the same numbers?"

record:  for every prompt, the prompt's token ids and logprobs, the greedy continuation's token ids,
         logprobs and text, and the server's model/engine info → a versioned, diff-friendly JSON file.
compare: replay the gold file's prompts one at a time, in order, against a server; any token-id mismatch
         or |Δ logprob| > tol fails, naming the worst prompt and position.

Engine-aware: vLLM via ``/v1/completions`` (``prompt_logprobs``, ``return_token_ids``: ids, never token
strings, which collide); SGLang via ``/generate`` (``return_logprob``, ``logprob_start_len=0``).

fit:     before recording, a prompt longer than the server's context leaves room for (``max_model_len`` minus
         the tokens to generate) is cut on a token boundary with the server's own tokenizer (``/tokenize``,
         both engines); the gold file keeps the cut prompt's token ids (``input_ids``) and compare sends exactly
         those ids, so a cut prompt replays token for token.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from mxlaunch import __version__
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.http import WAIT_FIX, ServerInfo, describe_exc, error_message, probe

GOLD_FORMAT = "mxlaunch-verify-gold"
GOLD_VERSION = 1
# Server-info fields whose difference is reported (never decisive).
INFO_FIELDS = ("api", "model", "engine_version", "max_model_len")


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


# ---------------------------------------------------------------- gold files


def _num(x: float | None) -> str:
    if x is None:
        return "null"
    if math.isnan(x) or math.isinf(x):
        return json.dumps(x)  # NaN / Infinity / -Infinity: Python's json reads them back
    return repr(float(x))  # shortest repr that round-trips exactly


def dumps_gold(gold: dict[str, Any]) -> str:
    """Pretty JSON with one ``[token_id, logprob]`` row per line, so `diff` points at positions."""
    lines = ["{"]
    head = {k: v for k, v in gold.items() if k != "prompts"}
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False, sort_keys=True)},")
    lines.append('  "prompts": [')
    for pi, p in enumerate(gold["prompts"]):
        lines.append("    {")
        for key in ("name", "text", "output_text", "finish_reason"):
            lines.append(f"      {json.dumps(key)}: {json.dumps(p.get(key), ensure_ascii=False)},")
        for key in ("cut_from_tokens", "input_ids"):  # a cut prompt: what was sent, on one line
            if key in p:
                lines.append(f"      {json.dumps(key)}: {json.dumps(p[key], separators=(',', ':'))},")
        for part in ("prompt", "output"):
            rows = p[part]
            lines.append(f'      "{part}": [')
            for ri, (tid, lp) in enumerate(rows):
                comma = "," if ri < len(rows) - 1 else ""
                lines.append(f"        [{int(tid)}, {_num(lp)}]{comma}")
            lines.append("      ]" + ("," if part == "prompt" else ""))
        lines.append("    }" + ("," if pi < len(gold["prompts"]) - 1 else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_gold(path: Path, gold: dict[str, Any]) -> None:
    """Atomic: a temp file next to the target, then rename."""
    path = Path(path)
    text = dumps_gold(gold)
    json.loads(text)  # never write a file we could not read back
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"cannot write gold file {path}: {describe_exc(exc)}", "pick a writable path") from None


def _bad(path: Path, what: str) -> UsageError:
    return UsageError(f"gold file {path} is malformed: {what}", "re-record it with `mxlaunch verify --record`")


def read_gold(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read gold file {path}: {describe_exc(exc)}", "pass the file --record wrote") from None
    try:
        gold = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(path, f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(gold, dict) or gold.get("format") != GOLD_FORMAT:
        raise _bad(path, f'no "format": "{GOLD_FORMAT}"')
    if gold.get("version") != GOLD_VERSION:
        raise UsageError(
            f"gold file {path} has version {gold.get('version')!r}; this mxlaunch reads version {GOLD_VERSION}",
            "re-record it with this mxlaunch",
        )
    req = gold.get("request")
    if not isinstance(req, dict) or not isinstance(req.get("max_tokens"), int) or req["max_tokens"] < 1:
        raise _bad(path, "request.max_tokens is missing or not a positive integer")
    prompts = gold.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise _bad(path, "no prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not isinstance(p.get("text"), str):
            raise _bad(path, f"prompts[{i}] needs a string name and text")
        for part in ("prompt", "output"):
            rows = p.get(part)
            if not isinstance(rows, list):
                raise _bad(path, f"prompts[{i}].{part} is not a list")
            for r, row in enumerate(rows):
                ok = (
                    isinstance(row, list)
                    and len(row) == 2
                    and isinstance(row[0], int)
                    and not isinstance(row[0], bool)
                    and (row[1] is None or (isinstance(row[1], (int, float)) and not isinstance(row[1], bool)))
                )
                if not ok:
                    raise _bad(path, f"prompts[{i}].{part}[{r}] is not [token_id, logprob]")
        if not p["prompt"]:
            raise _bad(path, f"prompts[{i}].prompt is empty")
        ids = p.get("input_ids")
        if ids is not None and not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
            raise _bad(path, f"prompts[{i}].input_ids is not a non-empty list of token ids")
    if not isinstance(gold.get("server"), dict):
        raise _bad(path, "no server info")
    return gold


# ---------------------------------------------------------------- record


def record(
    url: str,
    prompts: list[dict[str, str]],
    max_tokens: int,
    wait_s: float = 0.0,
    timeout: float = 120.0,
    on_prompt: Callable[[int, str], None] | None = None,
) -> dict[str, Any]:
    if max_tokens < 1:
        raise UsageError(f"--max-tokens {max_tokens} must be ≥ 1", "pass e.g. --max-tokens 32")
    info = probe(url, wait_s)
    scorer = Scorer(info, timeout)
    entries = []
    try:
        fitted, fit = fit_prompts(scorer, prompts, max_tokens)
        for i, p in enumerate(fitted):
            if on_prompt:
                on_prompt(i, p["name"])
            try:
                s = scorer.score(p.get("input_ids", p["text"]), max_tokens)
            except ServerGone as exc:
                raise UsageError(f"lost the server while recording prompt {p['name']!r}: {exc}", WAIT_FIX) from None
            except ServerRequestError as exc:
                raise UsageError(
                    f"server refused prompt {p['name']!r}: {exc}",
                    "check the server's --max-model-len, or use --prompts / a smaller --max-tokens",
                ) from None
            entries.append(_entry(p, s))
    finally:
        scorer.close()
    gold = {
        "format": GOLD_FORMAT,
        "version": GOLD_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "mxlaunch_version": __version__,
        "request": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": "chosen token"},
        "server": info.to_json(),
        "prompts": entries,
    }
    if fit is not None:
        gold["fit"] = fit
    return gold


def _entry(p: dict[str, Any], s: Scored) -> dict[str, Any]:
    """One gold prompt: what was sent (text; a cut prompt's ids too) and what the server scored."""
    entry: dict[str, Any] = {"name": p["name"], "text": p["text"]}
    entry.update({k: p[k] for k in ("cut_from_tokens", "input_ids") if k in p})
    entry.update({
        "output_text": s.output_text,
        "finish_reason": s.finish_reason,
        "prompt": [[t, lp] for t, lp in zip(s.prompt_ids, s.prompt_logprobs)],
        "output": [[t, lp] for t, lp in zip(s.output_ids, s.output_logprobs)],
    })
    return entry


# ---------------------------------------------------------------- fit prompts to the server's context


def fit_prompts(
    scorer: Scorer, prompts: list[dict[str, str]], max_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Prompts that leave `max_tokens` of room in the server's context, and what was cut.

    A prompt with more tokens than `max_model_len - max_tokens` (counted by the server's /tokenize) keeps its
    first tokens; it is sent as those token ids (`input_ids`), its `text` is their detokenization. Prompts that
    fit are sent as text, as before. A server that reports no max_model_len is not fitted.
    """
    limit = scorer.info.max_model_len
    if not limit:
        return [dict(p) for p in prompts], None
    budget = _prompt_budget(limit, max_tokens, scorer.info.api)
    fit: dict[str, Any] = {"max_model_len": limit, "max_tokens": max_tokens, "prompt_budget": budget, "cut": []}
    try:
        ids = {p["name"]: _tokenize(scorer, p) for p in prompts}
    except ServerRequestError as exc:  # no /tokenize (an older server): send as given; a refusal still says why
        return [dict(p) for p in prompts], {**fit, "not_fitted": f"/tokenize answered {exc}"}
    _require_room(prompts, ids, fit)
    out = []
    for p in prompts:
        tokens = ids[p["name"]]
        if len(tokens) <= budget:
            out.append(dict(p))
            continue
        kept = tokens[:budget]
        out.append({"name": p["name"], "text": _detokenize(scorer, kept), "cut_from_tokens": len(tokens),
                    "input_ids": kept})
        fit["cut"].append({"name": p["name"], "tokens": len(tokens), "kept": budget})
    return out, fit


def _prompt_budget(limit: int, max_tokens: int, api: str) -> int:
    """Tokens left for a prompt so that all `max_tokens` are generated; fewer than 2 is a usage error.

    vLLM: prompt + max_tokens <= max_model_len (0.32 shortens max_tokens silently beyond it). SGLang 0.5.23 keeps
    two tokens: max_req_len = context_len - 1, max_new_tokens is cut to max_req_len - input - 1, and an input
    must be shorter than max_req_len - 5 (srt/managers/tp_worker.py:568-572, scheduler.py:2714).
    """
    budget = limit - max_tokens if api != "sglang" else min(limit - max_tokens - 2, limit - 7)
    if budget < 2:
        raise UsageError(
            f"--max-tokens {max_tokens} leaves {max(budget, 0)} tokens for a prompt in the server's context "
            f"(max_model_len {limit})",
            "pass a smaller --max-tokens or start the server with a larger --max-model-len",
        )
    return budget


def _require_room(prompts: list[dict[str, str]], ids: dict[str, list[int]], fit: dict[str, Any]) -> None:
    """A server whose context cannot hold even the shortest prompt whole: cutting every prompt proves little."""
    shortest = min(prompts, key=lambda p: len(ids[p["name"]]))
    n = len(ids[shortest["name"]])
    if n > fit["prompt_budget"]:
        raise UsageError(
            f"the server's context is too small for every prompt: max_model_len {fit['max_model_len']} - "
            f"max_tokens {fit['max_tokens']} = {fit['prompt_budget']} tokens, and the shortest prompt "
            f"{shortest['name']!r} has {n}",
            "start the server with a larger --max-model-len (SGLang: --context-length), or pass a smaller "
            "--max-tokens or shorter --prompts",
        )


def _tokenize(scorer: Scorer, p: dict[str, str]) -> list[int]:
    try:
        return scorer.tokenize(p["text"])
    except ServerGone as exc:
        raise UsageError(f"lost the server while counting prompt {p['name']!r}'s tokens: {exc}", WAIT_FIX) from None


def _detokenize(scorer: Scorer, ids: list[int]) -> str:
    try:
        return scorer.detokenize(ids)
    except (ServerGone, ServerRequestError) as exc:
        return f"<{len(ids)} token ids; /detokenize failed: {exc}>"  # shown to people only: ids are what is sent


def fit_note(gold: dict[str, Any]) -> str | None:
    """One line naming the prompts cut to fit the server's context, and to what."""
    fit = gold.get("fit") or {}
    if fit.get("not_fitted"):
        return f"prompts not fitted to the server's context (max_model_len {fit['max_model_len']}): {fit['not_fitted']}"
    if not fit.get("cut"):
        return None
    cuts = ", ".join(f"{c['name']} {c['tokens']} → {c['kept']} tokens" for c in fit["cut"])
    return (f"cut {len(fit['cut'])} of {len(gold['prompts'])} prompts to fit the server's context (max_model_len "
            f"{fit['max_model_len']}, max_tokens {fit['max_tokens']}: {fit['prompt_budget']} tokens a prompt): {cuts}")


# ---------------------------------------------------------------- compare


def compare_prompt(gold_p: dict[str, Any], s: Scored, tol: float) -> dict[str, Any]:
    """Position by position: prompt tokens, then output tokens. Stops at the first token-id mismatch
    (what follows is conditioned on different tokens); logprobs are compared at every position before it."""
    n_prompt_gold = len(gold_p["prompt"])
    parts = (
        ("prompt", gold_p["prompt"], list(zip(s.prompt_ids, s.prompt_logprobs)), 0),
        ("output", gold_p["output"], list(zip(s.output_ids, s.output_logprobs)), n_prompt_gold),
    )
    max_delta = 0.0
    max_at: dict[str, Any] | None = None
    mismatch: dict[str, Any] | None = None
    compared = 0
    for part, exp_rows, got_rows, base in parts:
        for k in range(max(len(exp_rows), len(got_rows))):
            exp = exp_rows[k] if k < len(exp_rows) else None
            got = got_rows[k] if k < len(got_rows) else None
            where = {"position": base + k, "part": part, "offset": k}
            if exp is None or got is None or int(exp[0]) != int(got[0]):
                mismatch = {
                    **where,
                    "kind": "token_id",
                    "expected_id": None if exp is None else int(exp[0]),
                    "actual_id": None if got is None else int(got[0]),
                }
                break
            compared += 1
            e_lp, g_lp = exp[1], got[1]
            if e_lp is None and g_lp is None:
                continue
            if e_lp is None or g_lp is None:
                mismatch = {**where, "kind": "missing_logprob", "expected": e_lp, "actual": g_lp}
                break
            delta = abs(float(g_lp) - float(e_lp))
            if math.isnan(delta):
                delta = 0.0 if (math.isnan(e_lp) and math.isnan(g_lp)) or e_lp == g_lp else math.inf
            if max_at is None or delta > max_delta:
                max_delta = delta
                max_at = {**where, "delta": delta, "expected": float(e_lp), "actual": float(g_lp)}
        if mismatch:
            break
    over_tol = max_delta > tol
    return {
        "name": gold_p["name"],
        "pass": mismatch is None and not over_tol,
        "prompt_tokens": len(s.prompt_ids),
        "output_tokens": len(s.output_ids),
        "compared_positions": compared,
        "max_delta": max_delta,
        "max_delta_at": max_at,
        "mismatch": mismatch,
        "output_text": s.output_text,
        "error": None,
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def worst_of(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Token-id mismatches (and errors) first, earliest prompt first; otherwise the largest |Δ|."""
    for r in results:
        if r.get("error"):
            return {"prompt": r["name"], "position": None, "delta": None, "kind": "error", "error": r["error"]}
        if r.get("mismatch"):
            m = r["mismatch"]
            return {"prompt": r["name"], "delta": None, **m}
    best = None
    for r in results:
        at = r.get("max_delta_at")
        if at and (best is None or at["delta"] > best["delta"]):
            best = {"prompt": r["name"], **at, "kind": "logprob"}
    if best is not None:
        best["delta"] = _finite(best["delta"])
    return best


def info_differences(gold_server: dict[str, Any], info: ServerInfo) -> list[str]:
    now = info.to_json()
    return [
        f"{key}: gold {gold_server.get(key)!r} → now {now.get(key)!r}"
        for key in INFO_FIELDS
        if gold_server.get(key) != now.get(key)
    ]


def compare(
    url: str,
    gold: dict[str, Any],
    tol: float = 0.0,
    wait_s: float = 0.0,
    timeout: float = 120.0,
    on_prompt: Callable[[int, str], None] | None = None,
) -> dict[str, Any]:
    if not (tol >= 0) or math.isinf(tol):
        raise UsageError(f"--tol {tol} must be a finite number ≥ 0", "pass e.g. --tol 0 (exact) or --tol 1e-5")
    info = probe(url, wait_s)
    scorer = Scorer(info, timeout)
    max_tokens = gold["request"]["max_tokens"]
    results = []
    try:
        for i, p in enumerate(gold["prompts"]):
            if on_prompt:
                on_prompt(i, p["name"])
            try:
                s = scorer.score(p.get("input_ids", p["text"]), max_tokens)
            except ServerGone as exc:
                raise UsageError(f"lost the server while comparing prompt {p['name']!r}: {exc}", WAIT_FIX) from None
            except ServerRequestError as exc:
                results.append(
                    {"name": p["name"], "pass": False, "prompt_tokens": None, "output_tokens": None,
                     "compared_positions": 0, "max_delta": None, "max_delta_at": None, "mismatch": None,
                     "output_text": None, "error": str(exc)}
                )
                continue
            results.append(compare_prompt(p, s, tol))
    finally:
        scorer.close()
    passed = all(r["pass"] for r in results)
    deltas = [r["max_delta"] for r in results if r.get("max_delta") is not None]
    return {
        "pass": passed,
        "tol": tol,
        "worst": worst_of(results),
        "max_delta": _finite(max(deltas)) if deltas else None,
        "prompts_failed": sum(not r["pass"] for r in results),
        "prompts": [{**r, "max_delta": None if r["max_delta"] is None else _finite(r["max_delta"])} for r in results],
        "server": {"gold": gold.get("server"), "now": info.to_json(), "differences": info_differences(gold["server"], info)},
    }


def describe_worst(report: dict[str, Any]) -> str:
    """One line naming the worst prompt and position."""
    w = report.get("worst")
    if not w:
        return "no positions compared"
    if w["kind"] == "error":
        return f"prompt {w['prompt']!r}: the server answered with an error: {w['error']}"
    where = f"prompt {w['prompt']!r} position {w['position']} ({w['part']} token {w['offset']})"
    if w["kind"] == "token_id":
        exp = "end of output" if w["expected_id"] is None else f"token id {w['expected_id']}"
        got = "end of output" if w["actual_id"] is None else f"{w['actual_id']}"
        return f"{where}: expected {exp}, got {got}"
    if w["kind"] == "missing_logprob":
        return f"{where}: logprob expected {w['expected']}, got {w['actual']}"
    delta = w["delta"] if w["delta"] is not None else float("inf")
    return f"{where}: |Δ logprob| = {delta:.3g} (gold {w['expected']!r}, now {w['actual']!r})"


def check(report: dict[str, Any]) -> None:
    """Raise CheckFailed (exit 1) with the worst prompt named when the comparison failed."""
    if not report["pass"]:
        raise CheckFailed(
            f"verify failed: {report['prompts_failed']} of {len(report['prompts'])} prompts differ (tol "
            f"{report['tol']:g}); worst: {describe_worst(report)}"
        )
