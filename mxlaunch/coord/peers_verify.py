"""`mxlaunch peers --verify`: ask live sources to prove their own bytes, without a socket to them.

The request travels through the registry (a `<worker>.verify` file, or a Redis key); each source's
heartbeat thread takes it (it looks every second between beats), recomputes the checksum of every span it serves —
what a target would READ now — against the ones it published, answers, and stops offering itself on a
difference. Light: no torch here (the recomputing runs in the source's process).
"""

from __future__ import annotations

import time
from typing import Any

NO_ANSWER = "no answer"


def verify_sources(registry: Any, entries: list, timeout_s: float = 30.0, poll_s: float = 0.25) -> list[dict]:
    """One result per live entry: {"source_id", "rank", "worker", "ok", "bad", "seconds"} or, when the source
    did not answer within `timeout_s`, ok=False with "error": NO_ANSWER."""
    asked = {}
    for e in entries:
        r = e.record
        asked[(r.source_id, r.rank, r.worker)] = registry.request_verify(r.source_id, r.rank, r.worker)
    results: dict[tuple, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(asked) and time.monotonic() < deadline:
        for key, nonce in asked.items():
            if key not in results:
                answer = registry.verify_answer(*key, nonce)
                if answer is not None:
                    results[key] = answer
        if len(results) < len(asked):
            time.sleep(poll_s)
    out = []
    for (sid, rank, worker) in asked:
        got = results.get((sid, rank, worker), {"ok": False, "bad": [], "error": NO_ANSWER})
        out.append({"source_id": sid, "rank": rank, "worker": worker, "ok": bool(got.get("ok")),
                    "bad": list(got.get("bad", []))[:20], "tensors": got.get("tensors"),
                    "seconds": got.get("seconds"), **({"error": str(got["error"])[:300]} if got.get("error") else {})})
    return out
