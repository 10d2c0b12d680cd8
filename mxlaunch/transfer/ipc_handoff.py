"""CUDA IPC handles handed over a Unix socket to a peer of the same uid, never written into a record.

Why: an opened CUDA IPC handle grants READ and WRITE to the source's whole allocation to any process that has
its 64 bytes, whatever its uid (shown on the H200: another uid opened a handle, read the allocation and
overwrote it), and the driver has no read-only open (docs/security.md). So the bytes must reach only peers the
source's user trusts with its memory: its own uid. A P2P record travels further (group registries, Redis), so
it carries only this socket's address; the source's thread hands the handles to a connecting peer after the
kernel's word on who it is (SO_PEERCRED), and the peer checks the same of the source (the record's pid, its
own uid), so a name taken over after the source exited hands it nothing.

The socket is in Linux's abstract namespace ("@mxlaunch-ipc-<uid>-<pid>-<random>"): no file in a shared place to
squat, plant or clean up, gone with the process; a peer in another network namespace cannot reach it and pulls
over NIXL instead. No group is ever let in, MXLAUNCH_GROUP included: a handle is write access to the live
engine's weights, more than the group's "read snapshots and records".

Wire: the source sends one frame (4-byte big-endian length, then JSON) and closes: {"worker", "allocations":
[{"addr", "bytes", "handle"}]} to its own uid, {"refused": why} to anyone else. The peer sends nothing.
Stdlib only: the plugin's source thread imports nothing heavy, and the tests' second user runs it as is.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import selectors
import socket
import struct
import threading
from typing import Any, Callable, Optional

PREFIX = "mxlaunch-ipc-"
ADDRESS = re.compile(r"@mxlaunch-ipc-[0-9]{1,10}-[0-9]{1,10}-[0-9a-f]{8,64}")
MAX_FRAME = 4 << 20  # ~150 bytes an allocation: a handoff is a few KiB
HANDLE_BYTES = 64
IO_TIMEOUT_S = 5.0  # one peer's send or receive; the server serves one peer at a time
BACKLOG = 8
_FRAME = struct.Struct(">I")


class HandoffError(RuntimeError):
    """The handles could not be handed over (refused, unreachable, not the source, bad frame): pull over NIXL."""


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the other end, as the kernel recorded it at connect() or listen()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _kernel_name(address: str) -> str:
    if not ADDRESS.fullmatch(address):
        raise HandoffError(f"{address!r} is not a CUDA IPC handoff address")
    return "\0" + address[1:]


def _send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise HandoffError(f"the source closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class HandoffServer:
    """Hands `payload` to connecting peers of this uid, from one daemon thread, one peer at a time (each bounded
    by IO_TIMEOUT_S), until close() — or until `alive()` says the source stopped serving (its publication was
    withdrawn: `peers --verify` found its bytes changed, or it unpublished), when it refuses and closes itself."""

    def __init__(self, payload: dict, *, alive: Optional[Callable[[], bool]] = None) -> None:
        self.payload = payload
        self.alive: Callable[[], bool] = alive or (lambda: True)
        self.served = 0
        self.refusals: list[str] = []  # the last few, newest last (for the source's log and the tests)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.address = f"@{PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(16)}"
        try:
            self._sock.bind(_kernel_name(self.address))  # a random name: EADDRINUSE means someone guessed it
            self._sock.listen(BACKLOG)
        except OSError:
            self._sock.close()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "HandoffServer":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mxlaunch-ipc-handoff", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed.is_set():
                ready = {key.fileobj for key, _ in sel.select()}
                if self._wake_r in ready or self._closed.is_set():
                    break
                try:
                    conn, _ = self._sock.accept()
                except OSError:
                    continue
                with conn:
                    if not self._serve_one(conn):
                        break
        self._shut()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Answer one peer; False when the source stopped serving (the loop ends)."""
        conn.settimeout(IO_TIMEOUT_S)
        try:
            pid, uid, _gid = peer_cred(conn)
            if uid != os.getuid():
                why = f"uid {uid} (pid {pid}) is not this source's user: CUDA IPC handles go to uid {os.getuid()} only"
                self._refuse(why)
                _send_frame(conn, {"refused": why})
                return True
            if not self._still_serving():
                _send_frame(conn, {"refused": "this source stopped serving"})
                return False
            _send_frame(conn, self.payload)
            self.served += 1
        except OSError:  # a peer that went away or stalled: the next one is served
            pass
        return True

    def _still_serving(self) -> bool:
        try:
            return bool(self.alive())
        except Exception:  # noqa: BLE001 - a source that cannot tell whether it serves hands nothing out
            return False

    def _refuse(self, why: str) -> None:
        self.refusals = [*self.refusals[-9:], why]

    def _shut(self) -> None:
        self._closed.set()
        for close in (self._sock.close, lambda: os.close(self._wake_r)):
            try:
                close()
            except OSError:
                pass

    def close(self, timeout_s: float = IO_TIMEOUT_S + 1) -> None:
        """Stop handing out handles (idempotent): the thread ends (and the name is unbound) at once, or after the
        one peer it is answering (at most IO_TIMEOUT_S)."""
        if self._closed.is_set() and self._thread is None:
            return
        self._closed.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        elif thread is None:
            self._shut()
        try:
            os.close(self._wake_w)
        except OSError:
            pass

    def __enter__(self) -> "HandoffServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def valid_allocations(allocations: Any) -> bool:
    """[{"addr", "bytes", "handle"}]: non-negative ints, a handle of HANDLE_BYTES bytes in base64."""
    if not isinstance(allocations, list) or not allocations:
        return False
    for a in allocations:
        if not isinstance(a, dict) or not all(isinstance(a.get(k), int) and not isinstance(a.get(k), bool)
                                              and a[k] >= 0 for k in ("addr", "bytes")):
            return False
        try:
            if len(base64.b64decode(a.get("handle", ""), validate=True)) != HANDLE_BYTES:
                return False
        except (binascii.Error, ValueError, TypeError):
            return False
    return True


def fetch(address: str, *, pid: int, worker: str, timeout_s: float = IO_TIMEOUT_S) -> list[dict]:
    """The source's allocations with their handles, from the source at `address` — which must be process `pid`
    of this uid (the record's word, checked against the kernel's) and name itself `worker`. HandoffError
    otherwise, with why in one line."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(_kernel_name(address))
        except OSError as exc:
            raise HandoffError(f"cannot reach the source's handoff socket {address} ({exc.strerror or exc})") from exc
        their_pid, uid, _gid = peer_cred(sock)
        if uid != os.getuid() or their_pid != pid:
            raise HandoffError(f"the handoff socket {address} is held by uid {uid} pid {their_pid}, not the source "
                               f"(uid {os.getuid()} pid {pid}): not taking handles from it")
        try:
            (size,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
            if size > MAX_FRAME:
                raise HandoffError(f"the source sent a {size}-byte frame (at most {MAX_FRAME})")
            reply = json.loads(_recv_exact(sock, size))
        except (OSError, ValueError) as exc:
            raise HandoffError(f"no handles from the source's socket ({exc})") from exc
    if isinstance(reply, dict) and isinstance(reply.get("refused"), str):
        raise HandoffError(f"the source refused: {reply['refused'][:300]}")
    if not isinstance(reply, dict) or reply.get("worker") != worker or not valid_allocations(reply.get("allocations")):
        raise HandoffError("the source's handoff is not a valid list of allocations for this worker")
    return reply["allocations"]
