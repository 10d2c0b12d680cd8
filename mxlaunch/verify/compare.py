"""verify's comparison: a gold prompt against what the server scored now, position by position.

Why its own module: the pass/fail rule (token ids equal, |Δ logprob| ≤ tol), the choice of the worst
prompt and position, and the one-line verdict are pure functions of gold entries and `Scored` values; they
need no server and are tested on recorded data.
"""

from __future__ import annotations

import math
from typing import Any

from mxlaunch.errors import CheckFailed
from mxlaunch.http import ServerInfo
from mxlaunch.verify.scorer import Scored

# Server-info fields whose difference is reported (never decisive).
INFO_FIELDS = ("api", "model", "engine_version", "max_model_len")


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


def finite_or_none(x: float) -> float | None:
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
        best["delta"] = finite_or_none(best["delta"])
    return best


def info_differences(gold_server: dict[str, Any], info: ServerInfo) -> list[str]:
    now = info.to_json()
    return [
        f"{key}: gold {gold_server.get(key)!r} → now {now.get(key)!r}"
        for key in INFO_FIELDS
        if gold_server.get(key) != now.get(key)
    ]


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
