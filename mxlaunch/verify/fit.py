"""verify's prompt fitting: cut prompts that leave too little room in the server's context.

Why its own module: before recording, a prompt longer than the server's context leaves room for
(``max_model_len`` minus the tokens to generate, per engine) is cut on a token boundary with the server's own
tokenizer; the cut prompt's token ids go into the gold file so that compare replays it token for token.
"""

from __future__ import annotations

from typing import Any

from mxlaunch.errors import UsageError
from mxlaunch.http import WAIT_FIX
from mxlaunch.verify.scorer import Scorer, ServerGone, ServerRequestError


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
