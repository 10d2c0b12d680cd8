"""verify's gold file: its versioned JSON format, written atomically and read back with every field checked.

Why its own module: the file is the contract between `verify --record` and `verify --compare` (possibly
different mxlaunch versions on different machines); its layout (one ``[token_id, logprob]`` row per line,
so `diff` points at positions) and its validation live in one place.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from mxlaunch.errors import UsageError
from mxlaunch.http import describe_exc

GOLD_FORMAT = "mxlaunch-verify-gold"
GOLD_VERSION = 1


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
