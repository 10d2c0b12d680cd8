"""The zygote's serving loop: one fork per request, one pidfd per live child, exit when idle or unlinked.

Why a module of its own: the socket it publishes (bound under a temporary name, renamed into place), the
kernel's word on each peer's uid, and the fork and reap of each child are the zygote's protocol with the
launcher (warmstart/zygote.py), apart from how it imports (plugin/zygote.py) or stands still for CRIU
(plugin/zygote_dump.py). `beside` names the key's other files next to its socket.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
from typing import Dict, Optional, Tuple

from mxlaunch.contract import ZYGOTE_INFO, ZYGOTE_SOCKET
from mxlaunch.plugin.zygote_child import become_engine
from mxlaunch.transfer.ipc_handoff import peer_cred


def beside(socket_path: str, suffix: str) -> str:
    """The key's other file next to its socket: `<key>.json` (who serves), `<key>.refused` (why not)."""
    return socket_path.removesuffix(ZYGOTE_SOCKET) + suffix


class Zygote:
    """The serving loop: one fork per request, one pidfd per live child, exit when idle or unlinked."""

    def __init__(self, socket_path: str, entry: Tuple[str, str], idle_s: float) -> None:
        self.path = socket_path
        self.entry = entry
        self.idle_s = idle_s
        self.children: Dict[int, Tuple[int, socket.socket]] = {}  # pidfd → (pid, the client's connection)
        self.listener: Optional[socket.socket] = None
        self.inode: Optional[int] = None

    def publish(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(tmp)
        finally:
            os.umask(old)
        sock.listen(16)
        info = {"pid": os.getpid(), "python": sys.executable, "entry": list(self.entry), "started": time.time(),
                "idle_s": self.idle_s, "modules": len(sys.modules)}
        with open(f"{tmp}.json", "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(f"{tmp}.json", self.info_path)
        os.replace(tmp, self.path)
        self.inode = os.stat(self.path).st_ino
        self.listener = sock

    @property
    def info_path(self) -> str:
        return beside(self.path, ZYGOTE_INFO)

    def still_ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def serve(self) -> None:
        assert self.listener is not None
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([self.listener, *self.children], [], [], 2.0)
            for r in ready:
                if r is self.listener:
                    self._accept()
                    last = time.monotonic()
                else:
                    self._reap(r)
                    last = time.monotonic()
            if not self.still_ours():
                return
            if not self.children and time.monotonic() - last > self.idle_s:
                return

    def _accept(self) -> None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        _, uid, _ = peer_cred(conn)
        if uid != os.getuid():  # the folder's 0700 keeps others out; the kernel's word on the peer makes sure
            print(f"mxlaunch zygote: refused a request from uid {uid} (not this user)", flush=True)
            conn.close()
            return
        try:
            conn.settimeout(10.0)
            _, fds, _, _ = socket.recv_fds(conn, 1, 2)
            if len(fds) != 2:
                raise ValueError("the request carries no output and lifeline")
            with conn.makefile("rb") as f:
                req = json.loads(f.readline())
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            print(f"mxlaunch zygote: a bad request ({exc})", flush=True)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the loop
            code = 1
            try:
                assert self.listener is not None
                self.listener.close()
                conn.close()
                for pidfd, (_, other) in self.children.items():
                    os.close(pidfd)
                    other.close()
                code = become_engine(req, fds[0], fds[1], self.entry)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            pass
        self.children[os.pidfd_open(pid)] = (pid, conn)

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        try:
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        if self.still_ours():
            for path in (self.path, self.info_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        else:  # replaced or removed: the info file is ours only if it still names this process
            try:
                with open(self.info_path, encoding="utf-8") as f:
                    mine = json.load(f).get("pid") == os.getpid()
            except (OSError, ValueError):
                mine = False
            if mine:
                try:
                    os.unlink(self.info_path)
                except OSError:
                    pass
