"""The launcher's side of the warm interpreter (`mxlaunch launch --zygote`; the server: plugin/zygote.py).

A restart on a node where a zygote for the same engine, interpreter, folder and environment waits is forked
from it: the engine's imports are done already. Otherwise the engine is spawned as always, and once it is
ready a zygote is started for the next start (after ready, so it never competes with this one's imports).

The key is a digest of everything a child inherits from the zygote's imports rather than from its request:
the interpreter, the engine's version, the entry, the folder, and only the environment those imports read
(warmstart/zygote_env.py: names and prefixes found by tracing them), each value as a salted digest. Everything
else (which Slurm job, node, host or TMPDIR this is) reaches the child with its request, so a new job's first
start finds the zygote image the last job left in the store (issue 42). Sockets live in /dev/shm/mxlaunch-zygote-<uid>/ (0700), one per key. That
folder must be this user's own (ownership.own_root): where another user made the name first, this user's private
fallback `/dev/shm/mxlaunch-zygote-<uid>.XXXXXXXX` holds the sockets instead (zygotes keep working), and zygote
images are off (`image_blocker`): a restored image listens where it was dumped, in the name another user holds.

`ZygoteChild` stands in for subprocess.Popen where the launcher uses one: pid (its own process group),
stdout, poll(), wait(), returncode.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from mxlaunch.contract import ZYGOTE_INFO, ZYGOTE_REFUSED, ZYGOTE_SOCKET
from mxlaunch.engines.environment import PYTHON_EXE
from mxlaunch.fileutil import pid_alive
from mxlaunch.safety.logfile import open_log
from mxlaunch.warmstart.snapshot_key import digest
from mxlaunch.warmstart.zygote_env import IMPORT_TMPDIR, PINNED, import_env
from mxlaunch.plan import PLAN_ENV
from mxlaunch.safety.ownership import foreign, own_root, private_dir

SHM_ROOT = Path("/dev/shm")
IDLE_S = 900.0  # a zygote with no engine and no request for this long exits


@dataclass(frozen=True)
class ZygoteEntry:
    """What a zygote imports and how a child runs it: `python -m MODULE ARGS` or `SCRIPT ARGS`."""

    python: str
    kind: str  # "module" | "path"
    target: str  # the module name, or the console script's absolute path
    args: Tuple[str, ...]  # the command's arguments after the entry
    preload: Tuple[str, ...]

    def child_argv(self) -> list[str]:
        """sys.argv for the child (runpy puts the module's file in argv[0] itself)."""
        return [self.target, *self.args]

    def to_json(self) -> Dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k != "args"}


def entry_for(argv: Sequence[str], python: Optional[str], executable: Optional[str],
              preload: Sequence[str]) -> Tuple[Optional[ZygoteEntry], str]:
    """(entry, "") for a command a zygote can run, else (None, why not)."""
    if not argv or python is None or executable is None:
        return None, "cannot tell which Python runs the command"
    if PYTHON_EXE.match(os.path.basename(argv[0])):
        if len(argv) >= 3 and argv[1] == "-m":
            return ZygoteEntry(python, "module", argv[2], tuple(argv[3:]), tuple(preload)), ""
        return None, "only `python -m MODULE ...` (no interpreter options) runs from a zygote"
    if executable != python:  # a console script (its shebang names python)
        return ZygoteEntry(python, "path", executable, tuple(argv[1:]), tuple(preload)), ""
    return None, "the command is not a Python module or console script"


def zygote_root() -> Path:
    """This user's own folder for zygote sockets: the usual name when it is this user's own or not there yet (the
    callers that write make it 0700 and check it: private_root), else this user's private fallback (made when
    there is none yet: ownership.own_root)."""
    primary = SHM_ROOT / f"mxlaunch-zygote-{os.getuid()}"
    try:
        if foreign(os.lstat(primary), is_dir=True) is None:
            return primary
    except FileNotFoundError:
        return primary
    return own_root(SHM_ROOT, primary.name)[0] or primary


def image_blocker() -> Optional[str]:
    """Why zygote images are off on this node, or None. A zygote image serves at the socket path it was dumped
    with (/dev/shm/mxlaunch-zygote-<uid>/…) and reads its resume file beside it: where another user holds that
    name, a restored zygote would listen in their folder — anyone there could ask it to run code as this user."""
    primary = SHM_ROOT / f"mxlaunch-zygote-{os.getuid()}"
    root = zygote_root()
    if root == primary:
        return None
    why = own_root(SHM_ROOT, primary.name, create=False)[1] or f"{primary} is not this user's"
    return (f"{why}; zygotes use {root} instead, but an image restores only under the usual name — "
            "ask its owner or root to remove it")


def zygote_key(entry: ZygoteEntry, engine_version: Optional[str], env: Mapping[str, str], cwd: str,
               salt: bytes = b"") -> str:
    """The zygote's (and its image's) key: interpreter and entry, engine version, folder, and the variables its
    imports read (zygote_env.import_env), values as HMAC digests under this user's salt (snapshot_key.digest):
    a key in a log or a file name says nothing of a token's value."""
    kept = {k: digest(salt, v.encode()) for k, v in import_env(env).items() if k != PLAN_ENV}
    blob = json.dumps({"entry": entry.to_json(), "version": engine_version, "cwd": cwd, "env": sorted(kept.items())},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def socket_path(key: str) -> Path:
    return zygote_root() / f"{key}{ZYGOTE_SOCKET}"


def refusal_path(key: str) -> Path:
    """Written by a zygote that would not serve (its imports initialised CUDA or started threads)."""
    return zygote_root() / f"{key}{ZYGOTE_REFUSED}"


def refusal(key: str) -> Optional[str]:
    """Why the zygote for `key` would not serve, or None. Remove the file to let a new one try."""
    try:
        return refusal_path(key).read_text(encoding="utf-8").strip() or "refused"
    except OSError:
        return None


class ZygoteChild:
    """An engine forked by a zygote, driven like the Popen of a spawned one."""

    def __init__(self, pid: int, conn: socket.socket, stdout_fd: int, lifeline_fd: int) -> None:
        self.pid = pid
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode: Optional[int] = None
        self._conn = conn
        self._lifeline = lifeline_fd  # held open for the child's life: closing it (or dying) stops the engine
        self._buf = b""

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._read(block=False)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
            self._read(block=True, timeout=min(0.5, left) if left is not None else 0.5)
        assert self.returncode is not None
        return self.returncode

    def _read(self, *, block: bool, timeout: float = 0.0) -> None:
        self._conn.settimeout(timeout if block else 0.0)
        try:
            chunk = self._conn.recv(4096)
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the zygote is gone: the child's status can no longer be told, only whether it lives
            if not pid_alive(self.pid):
                self._finish(-1)
            return
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                self._finish(int(msg["exit"]))

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        try:
            os.close(self._lifeline)
        except OSError:
            pass


@dataclass(frozen=True)
class ZygoteInfo:
    """One zygote of this user's on this node, as `mxlaunch zygotes` lists it."""

    key: str
    status: str  # "waiting" (socket and process there) | "starting" (no socket yet) | "gone" | "refused"
    pid: Optional[int]
    entry: Optional[str]
    age_s: Optional[float]
    reason: str = ""

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def list_zygotes() -> list[ZygoteInfo]:
    """Every zygote file under zygote_root(): waiting ones, refusals, and leftovers of dead ones."""
    root = zygote_root()
    listed = (ZYGOTE_SOCKET, ZYGOTE_INFO, ZYGOTE_REFUSED)  # not the image handshake's markers (zygote_image.py)
    keys = sorted({p.name.split(".")[0] for p in root.iterdir() if p.suffix in listed} if root.is_dir() else set())
    found = []
    for key in keys:
        why = refusal(key)
        if why:
            found.append(ZygoteInfo(key, "refused", None, None, None, why))
            continue
        try:
            info = json.loads((root / f"{key}{ZYGOTE_INFO}").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {}
        pid = info.get("pid")
        entry = " ".join(info.get("entry") or []) or None
        age = round(time.time() - info["started"], 1) if info.get("started") else None
        alive = isinstance(pid, int) and pid_alive(pid)
        status = "waiting" if alive and socket_path(key).exists() else "gone"
        found.append(ZygoteInfo(key, status, pid, entry, age))
    return found


def stop_zygotes(wait_s: float = 5.0) -> list[str]:
    """Remove every socket, info and refusal file of this user's: each zygote exits within 2 s of its socket's
    removal (waited for, up to wait_s). Then the folder itself goes, with the zygotes' import TMPDIR, where
    nothing is left in them (remove_empty_root). The keys stopped."""
    root = zygote_root()
    keys, pids = [], []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.suffix == ZYGOTE_SOCKET:
            keys.append(path.stem)
        elif path.suffix == ZYGOTE_INFO:
            try:
                pids.append(int(json.loads(path.read_text(encoding="utf-8"))["pid"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        try:
            path.unlink()
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_empty_root(root)
    return keys


def remove_empty_root(root: Path) -> None:
    """Remove the zygote folder (its import TMPDIR first) where nothing is left in it, and only where it is a real
    folder of this user's (ownership.foreign): never another user's name, never through a link."""
    for folder in (root / IMPORT_TMPDIR, root):
        try:
            if foreign(os.lstat(folder), is_dir=True) is None:
                os.rmdir(folder)
        except OSError:  # not there, or not empty: something still lives in it
            pass


def private_root() -> bool:
    """Is zygote_root() private (private_dir)? A request carries the engine's whole environment (tokens
    included): it goes only to a socket in such a folder."""
    return private_dir(zygote_root())


def fork_from(key: str, entry: ZygoteEntry, env: Mapping[str, str], cwd: str) -> Optional[ZygoteChild]:
    """The engine, forked by the zygote for `key`; None when none serves it (then spawn as always). A socket
    nobody answers is removed; one in a folder that is not this user's alone is never used."""
    path = socket_path(key)
    if not path.exists() or not private_root() or path.lstat().st_uid != os.getuid():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    life_r, life_w = os.pipe()
    try:
        conn.settimeout(10.0)
        conn.connect(str(path))
        socket.send_fds(conn, [b"\0"], [out_w, life_r])
        conn.sendall(json.dumps({"argv": entry.child_argv(), "env": dict(env), "cwd": cwd}).encode() + b"\n")
        with conn.makefile("rb", buffering=0) as f:  # unbuffered: the exit line that may follow stays in the socket
            reply = json.loads(f.readline() or b"{}")
        pid = int(reply["pid"])
    except (OSError, ValueError, KeyError):
        conn.close()
        for fd in (out_r, life_w):
            os.close(fd)
        try:
            path.unlink()
        except OSError:
            pass
        return None
    finally:
        for fd in (out_w, life_r):
            os.close(fd)
    return ZygoteChild(pid, conn, out_r, life_w)


def start_zygote(key: str, entry: ZygoteEntry, env: Mapping[str, str], cwd: str,
                 log_dir: Path, idle_s: float = IDLE_S, for_image: bool = False) -> Optional[int]:
    """Start a zygote for `key` in the background (its own session; it outlives this launcher until idle);
    its pid, or None when one is already there or one refused. for_image: it stands still after its imports
    for a CRIU dump (warmstart/zygote_image.py ImageMaker), logging to zygote.log again only if unclaimed."""
    root = zygote_root()
    root.mkdir(mode=0o700, exist_ok=True)
    if not private_root():
        raise OSError(f"{root} is not a folder of this user's alone (mode 0700): remove it")
    path = socket_path(key)
    if path.exists():
        return None
    if refusal(key):
        return None
    cmd = [entry.python, "-m", "mxlaunch.plugin.zygote", "--socket", str(path),
           "--module" if entry.kind == "module" else "--path", entry.target,
           "--preload", ",".join(entry.preload), "--idle-s", str(idle_s)]
    tmp = root / IMPORT_TMPDIR  # the imports keep TMPDIR in module constants: one fixed private folder (zygote_env)
    tmp.mkdir(mode=0o700, exist_ok=True)
    env = {**{k: v for k, v in env.items() if k not in PINNED}, "TMPDIR": str(tmp)}
    log_dir.mkdir(parents=True, exist_ok=True)
    if for_image:
        cmd += ["--image-log", str(log_dir / "zygote.log")]
    with open_log(log_dir / "zygote.log", append=True) as log:  # 0600, O_NOFOLLOW (safety/logfile.py)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env), cwd=cwd, start_new_session=True)
    return proc.pid
