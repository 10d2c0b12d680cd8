"""The build-time half of P2P: while the engine builds the model, start this worker's NIXL agent (~1.3 s
on the H200 machine, most of it importing and starting UCX) and, for a pull, pick the source and open its
memory (plugin/p2p.prepare_pull) — in a background thread that the pull, or the publication as a source
after loading, joins. So neither a target's pull nor a source's publication waits for the agent."""

from __future__ import annotations

import logging
import threading
from typing import Any


def prepare_p2p(plan: Any, rank: int, log: logging.Logger) -> None:
    """A plan with a p2p block: start the agent in a background thread (strategy p2p: prepare the pull too)."""
    if plan is None or not getattr(plan, "p2p", None):
        return
    p = plan.p2p
    if plan.strategy != "p2p":
        if p.get("serve"):
            _preparing.append(threading.Thread(target=_start_agent, args=(rank, log), name="mx-nixl-start", daemon=True))
            _preparing[-1].start()
        return
    device, index = "cpu", 0
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device, index = "cuda", torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        pass

    def start() -> None:
        try:
            from mxlaunch.coord.peers import open_registry
            from mxlaunch.plugin import p2p

            _prepared.update(p2p.prepare_pull(registry=open_registry(p["registry"], None), source_id=plan.source_id,
                                              rank=rank % p["world"], world=p["world"], layout=p["layout"], device=device,
                                              device_index=index))
        except Exception as exc:  # noqa: BLE001 - the pull does it all then, and reports what fails
            log.warning("mxlaunch: rank %d could not prepare the P2P pull while the model is built: %s", rank, exc)

    _preparing.append(threading.Thread(target=start, name="mx-p2p-prepare", daemon=True))
    _preparing[-1].start()


_prepared: dict = {}
_preparing: list = []


def _start_agent(rank: int, log: logging.Logger) -> None:
    try:
        from mxlaunch.plugin import p2p_agent

        p2p_agent.agent()
    except Exception as exc:  # noqa: BLE001 - serve() reports it when it tries again
        log.debug("mxlaunch: rank %d: NIXL agent did not start early: %s", rank, exc)


def join_p2p_prepare(timeout_s: float = 120.0) -> dict:
    """Wait for the build-time preparation (the pull must not race the warm-up on the same agent)."""
    while _preparing:
        _preparing.pop().join(timeout_s)
    return dict(_prepared)
