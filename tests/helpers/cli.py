"""Run `mxlaunch ARGS` in a fresh interpreter, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`env`: the whole environment of the command (default: this process's)."""
    return subprocess.run([sys.executable, "-m", "mxlaunch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The contract for bad input: exactly one non-empty stderr line, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def compare_gold(url: str, gold: Path) -> dict:
    """`mxlaunch verify --compare` against a live server; asserts exact equality, returns the report."""
    import json

    result = run_cli("verify", "--url", url, "--compare", str(gold), "--json")
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    assert result.returncode == 0, (result.stderr, report.get("worst"))
    return report
