"""Claims on the shared filesystem (the default coordinator); the file primitives live in mxlaunch/fileutil.py.

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
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Optional

from mxlaunch.coord.base import ClaimInfo, LeasedClaim, valid_id
from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.fileutil import (  # noqa: F401 — the claims use them; older callers import them from here
    MAX_JSON_BYTES, boot_id, ensure_dir, pid_alive, process_start_time, read_json, secure, shared_gid, unique_name,
    write_json_atomic, write_json_temp)

CLAIMS_DIR = ".claims"

# ---- claims ----------------------------------------------------------------------------------------------

_UNREADABLE_STALE_S = 30.0  # a record that cannot be parsed counts as held until it is this old (+ grace)


class FileClaim(LeasedClaim):
    """A claim this process holds on the shared filesystem (generation `gen` of its source id)."""

    def __init__(self, coordinator: "FileCoordinator", info: ClaimInfo, gen: int) -> None:
        super().__init__(info)
        self._coord = coordinator
        self.gen = gen

    @property
    def path(self) -> Path:
        return self._coord.gen_path(self.source_id, self.gen)

    def _still_mine(self, now: float) -> bool:
        if self._coord.gen_path(self.source_id, self.gen + 1).exists():
            self._lost.set()  # already taken over
            return False
        return super()._still_mine(now)

    def _beat(self, info: ClaimInfo) -> bool:
        write_json_atomic(self.path, info.to_json())
        return True


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
