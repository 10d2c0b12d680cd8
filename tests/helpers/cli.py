"""Run `mxlaunch ARGS` in a fresh interpreter, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxlaunch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The contract for bad input: exactly one non-empty stderr line, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]
