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

This module runs the two (record, compare) against a server; the parts live beside it: scorer.py (the
engines' dialects), gold.py (the file), fit.py (cutting prompts), compare.py (the verdict). Their
public names are importable from here too.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any, Callable

from mxlaunch import __version__
from mxlaunch.errors import UsageError
from mxlaunch.http import WAIT_FIX, probe
from mxlaunch.verify.compare import (
    INFO_FIELDS,
    check,
    compare_prompt,
    describe_worst,
    finite_or_none,
    info_differences,
    worst_of,
)
from mxlaunch.verify.fit import fit_note, fit_prompts
from mxlaunch.verify.gold import GOLD_FORMAT, GOLD_VERSION, dumps_gold, read_gold, write_gold
from mxlaunch.verify.scorer import (
    Scored,
    Scorer,
    ServerGone,
    ServerRequestError,
    sglang_parse,
    sglang_request,
    vllm_parse,
    vllm_request,
)

__all__ = [
    "GOLD_FORMAT", "GOLD_VERSION", "INFO_FIELDS", "Scored", "Scorer", "ServerGone", "ServerRequestError",
    "check", "compare", "compare_prompt", "describe_worst", "dumps_gold", "fit_note", "fit_prompts",
    "info_differences", "read_gold", "record", "sglang_parse", "sglang_request", "vllm_parse", "vllm_request",
    "worst_of", "write_gold",
]


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
        "max_delta": finite_or_none(max(deltas)) if deltas else None,
        "prompts_failed": sum(not r["pass"] for r in results),
        "prompts": [{**r, "max_delta": None if r["max_delta"] is None else finite_or_none(r["max_delta"])}
                    for r in results],
        "server": {"gold": gold.get("server"), "now": info.to_json(), "differences": info_differences(gold["server"], info)},
    }
