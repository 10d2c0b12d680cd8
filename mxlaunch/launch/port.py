"""The engine's HTTP port: checked before the engine starts, and its bind failure caught while it starts.

Why both: a port already taken is the commonest way a launch dies late — after the interpreters have
imported and the weights are staged — and SGLang 0.5.23 then *hangs* ("Waiting for application
shutdown.") instead of exiting, so a launcher that only waits for /health waits out its ready timeout.
The check before the spawn catches a port held now (exit 2, nothing started); `bind_failure` catches one
taken in between (a race) from the engine's own log line, so the launcher stops the engine at once.
"""

from __future__ import annotations

import errno
import re
import socket
from typing import Optional

from mxlaunch.errors import UsageError

# uvicorn's wording (vLLM's and SGLang's HTTP servers both run uvicorn), e.g.
#   ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 38741): address already in use
_UVICORN_BIND = re.compile(r"error while attempting to bind on address \((?P<addr>[^)]*)\):\s*(?P<why>.+)$", re.I)


def bind_host(host: Optional[str]) -> str:
    """The address the engine binds: every interface when the command names none (both engines' default)."""
    return "0.0.0.0" if host in (None, "") else host


def check_free(host: Optional[str], port: int) -> None:
    """Raise UsageError (exit 2) when the engine could not bind host:port now. The probe sets SO_REUSEADDR
    as uvicorn does, so a port left in TIME_WAIT by a server that just stopped counts as free."""
    where = bind_host(host)
    family = socket.AF_INET6 if ":" in where else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((where, port))
        except OSError as exc:
            raise _bind_error(where, port, exc) from None


def _bind_error(host: str, port: int, exc: OSError) -> UsageError:
    if exc.errno == errno.EADDRINUSE:
        holder = holder_of(port)
        return UsageError(f"port {port} on {host} is already in use{f' (held by {holder})' if holder else ''}",
                          "stop what listens there or pass the engine another --port")
    if exc.errno == errno.EACCES:
        return UsageError(f"port {port} on {host} needs privileges this user lacks", "pass --port 1024 or above")
    if exc.errno == errno.EADDRNOTAVAIL:
        return UsageError(f"--host {host} is not an address of this machine",
                          "pass --host 0.0.0.0 (every interface) or one of this node's addresses")
    return UsageError(f"the engine could not bind {host}:{port}: {exc.strerror or exc}",
                      "pass the engine another --host/--port")


def holder_of(port: int) -> Optional[str]:
    """'name, pid N' of the process listening on `port`, where this user may see it; else None."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                try:
                    return f"{psutil.Process(conn.pid).name()}, pid {conn.pid}"
                except psutil.Error:
                    return f"pid {conn.pid}"
    except Exception:  # psutil may be denied /proc/net or other users' sockets: the name is a courtesy
        return None
    return None


def bind_failure(line: str, port: int) -> Optional[str]:
    """The problem, when `line` is the engine's HTTP server failing to bind `port`; else None."""
    match = _UVICORN_BIND.search(line.strip())
    if match is None or not re.search(rf"\b{port}\b", match["addr"]):
        return None
    return f"the engine could not bind its HTTP port {port}: {match['why'].strip()}"
