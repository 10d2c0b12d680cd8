"""The launcher's side of P2P: can this launch pull from a live source, and what the plan file says.

The launcher never touches NIXL or torch: it reads the peer registry (coord/peers.py) to decide, writes
the plan's p2p block (registry, layout, world, run id, serve), and at exit removes every record its
run's workers published (a worker killed with the engine cannot unpublish itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mxlaunch import settings
from mxlaunch.engines.environment import engine_python

P2P_TIMEOUT_S = 300.0
_NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")


def layout_for(device_type: str) -> str:
    """GPU sources serve their post-processed tensors (zero-copy); CPU sources a host copy of the raw
    ones (vLLM's CPU post-processing leaves parameters empty: processed tensors cannot be pulled there)."""
    return "processed" if device_type == "cuda" else "raw"


def nixl_reachable(argv: list[str]) -> bool:
    """Can the engine's Python import NIXL? (Checked without importing it: find_spec only.)"""
    python = engine_python(argv) or sys.executable
    if os.path.realpath(python) == os.path.realpath(sys.executable):  # the launcher's own Python: no child needed
        import importlib.util

        return any(importlib.util.find_spec(m) for m in _NIXL_MODULES)
    code = ("import importlib.util as u, sys\n"
            f"sys.exit(0 if any(u.find_spec(m) for m in {_NIXL_MODULES!r}) else 3)")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, timeout=60, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@dataclass
class P2PDecision:
    """What the registry offers this launch: live sources per snapshot rank, and whether to serve."""

    registry: str
    layout: str
    world: int
    serve: bool
    sources: dict[int, list[dict]] = field(default_factory=dict)
    why_not: Optional[str] = None  # why this launch cannot pull (None: every local rank has a source)

    @property
    def can_pull(self) -> bool:
        return self.why_not is None

    def describe(self) -> str:
        hosts = sorted({f"{s['host']} pid {s['pid']}" for found in self.sources.values() for s in found})
        return f"{len(hosts)} live P2P source(s) in {self.registry}: {', '.join(hosts[:4])}"

    def to_json(self) -> dict[str, Any]:
        return {"registry": self.registry, "layout": self.layout, "world": self.world, "serve": self.serve,
                "can_pull": self.can_pull, "why_not": self.why_not,
                "sources": {str(r): found for r, found in sorted(self.sources.items())}}

    def block(self, run_id: str) -> dict[str, Any]:
        """The plan file's p2p block (plan.py)."""
        return {"registry": self.registry, "layout": self.layout, "world": self.world, "run_id": run_id,
                "serve": self.serve, "timeout_s": P2P_TIMEOUT_S}


def decide_p2p(*, enabled: bool, registry_url: Optional[str], store_root: Path, source_id: str, device_type: str,
               world: int, snapshot_ranks: list[int], argv: list[str]) -> Optional[P2PDecision]:
    """None when P2P is off (--no-p2p); else the registry's offer for every local snapshot rank."""
    if not enabled:
        return None
    from mxlaunch.coord.peers import open_registry

    settings.nixl_ucx_params()  # a malformed NIXL setting stops the launch here (exit 2), not in each worker
    settings.nixl_pull()

    registry = open_registry(registry_url or settings.registry(), store_root)
    layout = layout_for(device_type)
    decision = P2PDecision(registry.url, layout, world, serve=True)
    if not nixl_reachable(argv):
        decision.serve = False
        decision.why_not = "NIXL is not installed in the engine's Python (pip install 'mxlaunch[p2p]' there)"
        return decision
    for rank in snapshot_ranks:
        found = [e for e in registry.sources(source_id, rank) if e.record.world == world and e.record.layout == layout]
        decision.sources[rank] = [{"worker": e.record.worker, "host": e.record.host, "pid": e.record.pid,
                                   "age_s": round(e.age_s, 1)} for e in found]
    empty = [r for r in snapshot_ranks if not decision.sources.get(r)]
    if empty:
        decision.why_not = f"no live P2P source of rank {empty[0]} ({layout} layout, {world} ranks) in {registry.url}"
        refused = list(getattr(registry, "refusals", []))  # records others could have written: never trusted
        if refused:
            decision.why_not += f" ({len(refused)} refused: {refused[0]})"
    return decision


def unpublish_run(decision: Optional[P2PDecision], run_id: str, store_root: Path) -> int:
    """Remove every record this run's workers published (the engine has stopped); never raises."""
    if decision is None or not decision.serve:
        return 0
    try:
        from mxlaunch.coord.peers import open_registry

        return open_registry(decision.registry, store_root).remove_run(run_id)
    except Exception:  # noqa: BLE001 - stale records are skipped by readers and reaped later
        return 0
