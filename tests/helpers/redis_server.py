"""A real redis-server for the redis tests: scripts/services/start_redis.sh starts it (installing Debian's package
with apt-get when missing and running as root — CI's case) on a free loopback port, no persistence, with
`requirepass` (mxlaunch refuses a Redis registry without a password): the URL carries the password."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
START = REPO / "scripts" / "services" / "start_redis.sh"


def start_redis(folder: Path, password: str | None = None) -> str:
    """Start a server whose files live in `folder`, with a fresh random password unless one is given ("" for
    none); its URL (db 0, password in it). Raises RuntimeError with the script's words."""
    password = secrets.token_hex(16) if password is None else password
    proc = subprocess.run(["bash", str(START), "start", str(folder), *([password] if password else [])],
                          capture_output=True, text=True, timeout=900)
    port = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not port.isdigit():
        raise RuntimeError(f"could not start redis-server ({proc.returncode}): {proc.stderr[-2000:]} (files in {folder})")
    return f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"


def stop_redis(folder: Path) -> None:
    subprocess.run(["bash", str(START), "stop", str(folder)], capture_output=True, timeout=60)


def redis_session(folder: Path) -> Iterator[str]:
    """Generator for a session fixture: the URL while the server runs; stopped afterwards."""
    try:
        url = start_redis(folder)
    except RuntimeError:
        stop_redis(folder)
        raise
    try:
        yield url
    finally:
        stop_redis(folder)
