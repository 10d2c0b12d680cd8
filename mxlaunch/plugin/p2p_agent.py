"""This worker's one NIXL agent and the memory it has registered — shared by the target (plugin/p2p.py) and
the source (plugin/p2p_source.py) sides: the memory a target registered to pull into is what it serves
afterwards, so becoming a source costs no second registration. Its own module so that neither side owns the
other's state."""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import threading
from typing import Any, Sequence

from mxlaunch.transfer.regions import Region

_lock = threading.Lock()
_agent: Any = None
_regions: list[Region] = []


def worker_name() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def agent() -> Any:
    """This worker's NIXL agent (started once; its start overlaps nothing else worth measuring)."""
    global _agent
    with _lock:
        if _agent is None:
            from mxlaunch.transfer.nixl import Agent

            _agent = Agent(worker_name())
            atexit.register(close_agent)  # after p2p_source._unpublish_all (atexit runs the last registered first)
        return _agent


def close_agent() -> None:
    """Destroy this worker's agent before the interpreter's exit tears UCX down under it."""
    global _agent
    with _lock:
        if _agent is not None:
            _agent.close()
            _agent = None
        _regions.clear()


def register_once(regions: Sequence[Region]) -> float:
    """Register regions not registered yet by this worker; returns seconds spent."""
    new = [r for r in regions if not any(o.kind == r.kind and o.dev == r.dev and o.addr <= r.addr and r.end <= o.end
                                         for o in _regions)]
    if not new:
        return 0.0
    took = agent().register(new)
    _regions.extend(new)
    return took
