"""One rank's side of the marker protocol with the launcher (mxlaunch/plan.py's markers folder): the markers it
writes (never fatal, with the rendezvous file the launcher removes after the run), the fallback it reports,
the abort the launcher writes when staging failed, and the wait for a rank's staged files that the abort
cuts short. Apart from RankLoad's strategies (plugin/rank_load.py) because the SGLang sharded loader and
the snapshot paths speak it too, without a RankLoad."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mxlaunch.contract import ABORT, FALLBACK, RENDEZVOUS_FILE
from mxlaunch.plan import Plan, write_marker


def rendezvous_file() -> str | None:
    """The file torch.distributed's default group met through when it is a FileStore (vLLM's `file://`
    init), so that the launcher can remove it after the run: vLLM never does. None otherwise."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore wrappers
            store = store.underlying_store
        path = getattr(store, "path", None)
        return str(path) if path else None
    except Exception:  # noqa: BLE001
        return None


def safe_marker(plan: Any, kind: str, rank: int, payload: dict, log: logging.Logger) -> None:
    """Write a marker; a failure is logged, never raised (a marker must not take the engine down)."""
    store_file = rendezvous_file()
    if store_file is not None:
        payload = {**payload, RENDEZVOUS_FILE: store_file}
    try:
        write_marker(plan, kind, rank, payload)
    except Exception as exc:  # noqa: BLE001
        log.warning("mxlaunch: rank %d could not write marker %s: %s", rank, kind, exc)


def report_fallback(plan: Any, rank: int, reason: str, log: logging.Logger, engine: str | None = None) -> None:
    """Say (log and marker) that this rank serves with the engine's default loader, and why."""
    if engine:
        log.warning("mxlaunch: rank %d falls back to %s's default loader: %s", rank, engine, reason)
    else:
        log.warning("mxlaunch: rank %d: %s", rank, reason)
    safe_marker(plan, FALLBACK, rank, {"reason": reason, "strategy": plan.strategy}, log)


def fall_back_or_stop(plan: Any, rank: int, reason: str, log: logging.Logger, engine: str) -> None:
    """Before any tensor landed: fall back when the plan allows it, else stop the engine."""
    if not plan.fallback_ok:
        raise RuntimeError(f"mxlaunch: rank {rank}: {reason} and the plan forbids falling back")
    report_fallback(plan, rank, reason, log, engine)


def wait_for_rank_files(plan: Any, files: list, rank: int, what: str) -> str | None:
    """None once every file of the rank has landed with its size (loaders that read a whole folder
    start only then), else why not."""
    from mxlaunch.plugin.loader import RestoreError, wait_for_file

    if not files:
        return f"the plan lists no files for rank {rank}"
    try:
        for f in files:
            wait_for_file(f.path, plan.wait_timeout_s, cancelled=lambda: aborted(plan))
    except RestoreError as exc:
        return f"{what} restore failed before loading: {exc}"
    sizes = {f.path: Path(f.path).stat().st_size for f in files}
    wrong = [p for p, f in zip(sizes, files) if sizes[p] != f.bytes]
    if wrong:
        return f"{wrong[0]} has {sizes[wrong[0]]} bytes, the snapshot says otherwise"
    return None


def aborted(plan: Plan) -> bool:
    """The launcher writes markers/abort.json when staging failed: stop waiting for files."""
    return (plan.markers_dir / ABORT).exists()


def abort_reason(plan: Plan) -> str:
    try:
        return str(json.loads((plan.markers_dir / ABORT).read_text()).get("reason", "no reason given"))
    except (OSError, ValueError, AttributeError):
        return "no reason given"
