"""A real redis-server for the redis tests: scripts/start_redis.sh starts it (installing Debian's package
with apt-get when missing and running as root — CI's case) on a free loopback port, no persistence."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
START = REPO / "scripts" / "start_redis.sh"


def start_redis(folder: Path) -> str:
    """Start a server whose files live in `folder`; its URL (db 0). Raises RuntimeError with the script's words."""
    proc = subprocess.run(["bash", str(START), "start", str(folder)], capture_output=True, text=True, timeout=900)
    port = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not port.isdigit():
        raise RuntimeError(f"could not start redis-server ({proc.returncode}): {proc.stderr[-2000:]} (files in {folder})")
    return f"redis://127.0.0.1:{port}/0"


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
