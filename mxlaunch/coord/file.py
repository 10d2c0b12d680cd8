"""Claims on the shared filesystem (the default coordinator) and the small file primitives the store shares.

A claim on a source id is a sequence of generation files `<root>/.claims/<source_id>/<gen>.claim`
(gen = 1, 2, 3 ... with no gaps; files are never deleted while the store keeps the snapshot folder), each
a JSON `ClaimInfo`: host, pid, boot id, process start time, expires_at. The newest generation is the claim.

- claim:     find the newest generation g (galloping stat probes); if its holder is live, lose. Otherwise
             write the record to a temp name and `link()` it to generation g+1: link fails with EEXIST for
             every racer but one, so each generation has exactly one winner, and nothing is ever moved or
             overwritten by anyone but its holder. This is what makes take-over race-free.
- heartbeat: the holder rewrites only its own generation (temp + rename), and only before its own expiry
             and while no newer generation exists; otherwise the claim is `lost`.
- stale:     a generation is free when released, when its lease ended more than `grace_s` ago, or when its
             holder ran on this host (same boot) and that process is gone (pid + start time; zombies count
             as gone).
- release:   the holder rewrites its generation as released (expires_at 0).

Files and folders are created with the user's umask, never world-writable; with `MXLAUNCH_GROUP` set they
get that group, g+rw, and folders g+s.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import secrets
import socket
import stat
import threading
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, Optional

from mxlaunch.coord.base import ClaimInfo, valid_id
from mxlaunch.errors import CheckFailed, UsageError

CLAIMS_DIR = ".claims"
MAX_JSON_BYTES = 64 << 20

# ---- file primitives (shared with store.py) ------------------------------------------------------------


def shared_gid() -> Optional[int]:
    """The group named by MXLAUNCH_GROUP (name or number), or None when unset."""
    name = os.environ.get("MXLAUNCH_GROUP", "").strip()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError as exc:
        raise UsageError(f"MXLAUNCH_GROUP={name} is not a group on this host", "unset it or name a group you are in") from exc


def secure(path: str | os.PathLike[str], *, is_dir: bool) -> None:
    """Drop o+w (never world-writable); with MXLAUNCH_GROUP: that group, g+rw, and g+s on folders."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    new = mode & ~0o002
    gid = shared_gid()
    if gid is not None:
        if st.st_gid != gid:
            try:
                os.chown(path, -1, gid)
            except PermissionError as exc:
                raise UsageError(f"cannot give {path} the group {gid} (MXLAUNCH_GROUP)",
                                 "use a group you are a member of, or unset MXLAUNCH_GROUP") from exc
        new |= 0o060 | (0o2010 if is_dir else 0)
    if new != mode or gid is not None:
        os.chmod(path, new)


def ensure_dir(path: str | os.PathLike[str]) -> Path:
    """mkdir -p; each folder this call creates gets `secure()` (umask, no o+w, optional group)."""
    p = Path(path)
    if p.is_dir():
        return p
    if not p.parent.is_dir() and p.parent != p:
        ensure_dir(p.parent)
    try:
        p.mkdir()
    except FileExistsError:
        if not p.is_dir():
            raise
        return p
    secure(p, is_dir=True)
    return p


def unique_name(prefix: str) -> str:
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def write_json_temp(folder: str | os.PathLike[str], obj: Any, prefix: str = ".") -> Path:
    """Write JSON to a fresh, uniquely named file in `folder` (fsynced, secured); the caller renames or links it."""
    tmp = Path(folder) / (unique_name(prefix) + ".tmp")
    payload = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        secure(tmp, is_dir=False)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, exclusive: bool = False) -> bool:
    """Make `path` hold `obj` by one atomic step; nothing half-written is ever visible under `path`.

    exclusive=False replaces what is there (rename). exclusive=True publishes only if `path` does not
    exist yet and returns whether this call won: `link()` fails with EEXIST for every racer but one. On a
    filesystem without hard links an O_EXCL `<path>.lock` decides the single winner instead.
    """
    target = Path(path)
    tmp = write_json_temp(target.parent, obj, prefix=f".{target.name}.")
    try:
        if not exclusive:
            os.replace(tmp, target)
            return True
        try:
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
        lock = target.with_name(target.name + ".lock")
        try:
            os.close(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            return False
        if target.exists():
            return False
        os.replace(tmp, target)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES) -> Any:
    """Read a JSON file of at most `limit` bytes (regular file only). Raises OSError / ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        data = fh.read(limit + 1)
    return json.loads(data.decode("utf-8"))


# ---- who am I, is that process alive -------------------------------------------------------------------


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat); 0 when unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """Is `pid` running (not a zombie) and, when start_time is known, still the same process?"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X"):
            return False
        if start_time and int(fields[19]) != start_time:
            return False  # the pid was reused
    except (OSError, ValueError, IndexError):
        pass
    return True


# ---- claims ----------------------------------------------------------------------------------------------

_UNREADABLE_STALE_S = 30.0  # a record that cannot be parsed counts as held until it is this old (+ grace)


class FileClaim:
    """A claim this process holds on the shared filesystem (generation `gen` of its source id)."""

    def __init__(self, coordinator: "FileCoordinator", info: ClaimInfo, gen: int) -> None:
        self._coord = coordinator
        self._info = info
        self.gen = gen
        self.source_id = info.source_id
        self.token = info.token
        self._lost = threading.Event()
        self._released = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def info(self) -> ClaimInfo:
        return self._info

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def path(self) -> Path:
        return self._coord.gen_path(self.source_id, self.gen)

    def _still_mine(self, now: float) -> bool:
        if now >= self._info.expires_at or self._coord.gen_path(self.source_id, self.gen + 1).exists():
            self._lost.set()  # expired (a racer may take over from now on) or already taken over
            return False
        return True

    def heartbeat(self) -> bool:
        """Extend the lease by ttl_s. False (and `lost`) once the lease ran out or a newer claim exists."""
        with self._lock:
            if self._released or self.lost or not self._still_mine(time.time()):
                return False
            info = replace(self._info, expires_at=time.time() + self._info.ttl_s)
            write_json_atomic(self.path, info.to_json())
            self._info = info
            return True

    def keep_alive(self, interval_s: float | None = None) -> None:
        """Heartbeat from a daemon thread every interval (default ttl/3) until release() or the claim is lost."""
        if self._thread is not None:
            return
        interval = self._info.ttl_s / 3 if interval_s is None else interval_s

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    if not self.heartbeat():
                        return
                except OSError:
                    continue  # a transient filesystem error: the next beat retries before the lease ends

        self._thread = threading.Thread(target=loop, name=f"mxlaunch-claim-{self.source_id}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the claim back (idempotent); a lost or expired claim is left alone."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._released:
                return
            self._released = True
            if not self.lost and self._still_mine(time.time()):
                info = replace(self._info, expires_at=0.0, released=True)
                write_json_atomic(self.path, info.to_json())
                self._info = info

    def __enter__(self) -> "FileClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FileCoordinator:
    """Claims under `<root>/.claims/`. `host` is overridable for tests (another host: no pid check)."""

    def __init__(self, root: str | os.PathLike[str], *, host: str | None = None, grace_s: float = 2.0) -> None:
        self.root = Path(root)
        self.dir = self.root / CLAIMS_DIR
        self.host = host or socket.gethostname()
        self.grace_s = grace_s
        self._boot_id = boot_id()

    def claim_dir(self, source_id: str) -> Path:
        if not valid_id(source_id):
            raise UsageError(f"{source_id!r} is not a valid source id", "use the id `mxlaunch store list` shows")
        return self.dir / source_id

    def gen_path(self, source_id: str, gen: int) -> Path:
        return self.claim_dir(source_id) / f"{gen:08d}.claim"

    def newest_gen(self, source_id: str) -> int:
        """The newest generation (0: never claimed). Generations have no gaps: gallop, then bisect."""
        def exists(g: int) -> bool:
            return self.gen_path(source_id, g).exists()

        if not exists(1):
            return 0
        lo, hi = 1, 2
        while exists(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # exists(lo), not exists(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if exists(mid) else (lo, mid)
        return lo

    def try_claim(self, source_id: str, ttl_s: float = 30.0, *, extra: dict[str, Any] | None = None) -> Optional[FileClaim]:
        if ttl_s <= 0:
            raise UsageError(f"claim ttl {ttl_s} must be > 0", "pass a lease length in seconds")
        folder = ensure_dir(self.claim_dir(source_id))
        for _ in range(16):
            gen = self.newest_gen(source_id)
            if gen and not self._stale(self.gen_path(source_id, gen)):
                return None
            now = time.time()
            info = ClaimInfo(
                source_id=source_id, token=secrets.token_hex(16), host=self.host, pid=os.getpid(),
                boot_id=self._boot_id, start_time=process_start_time(os.getpid()), created_at=now,
                expires_at=now + ttl_s, ttl_s=float(ttl_s), extra=dict(extra or {}),
            )
            tmp = write_json_temp(folder, info.to_json())
            try:
                os.link(tmp, self.gen_path(source_id, gen + 1))
                return FileClaim(self, info, gen + 1)
            except FileExistsError:
                continue  # another racer took generation gen+1: look again (it is live, so we lose)
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                raise CheckFailed(f"{folder} does not support hard links, which file claims need",
                                  "put the artifact store on a POSIX filesystem (Lustre, NFS, ext4, xfs)") from exc
            finally:
                tmp.unlink(missing_ok=True)
        return None

    def holder(self, source_id: str) -> Optional[ClaimInfo]:
        gen = self.newest_gen(source_id)
        if not gen:
            return None
        path = self.gen_path(source_id, gen)
        info = self._read(path)
        return info if isinstance(info, ClaimInfo) and not self._stale(path) else None

    # ---- internals ----

    def _read(self, path: Path) -> ClaimInfo | str | None:
        """The record; None when no file; 'unreadable' when present but not a valid record."""
        try:
            data = read_json(path, limit=1 << 20)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return "unreadable"
        info = ClaimInfo.from_json(data)
        return info if info is not None else "unreadable"

    def _stale(self, path: Path) -> bool:
        current = self._read(path)
        now = time.time()
        if current is None:
            return True
        if not isinstance(current, ClaimInfo):
            try:
                return now - os.stat(path).st_mtime > _UNREADABLE_STALE_S + self.grace_s
            except OSError:
                return True
        if current.released or now > current.expires_at + self.grace_s:
            return True
        if current.host == self.host and current.boot_id and current.boot_id == self._boot_id:
            return not pid_alive(current.pid, current.start_time)
        return False
