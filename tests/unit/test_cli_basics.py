"""The CLI's contract: version, help lists real commands, usage errors exit 2 without a traceback."""

from __future__ import annotations

import subprocess
import sys

from mxlaunch import __version__


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxlaunch.cli", *args], capture_output=True, text=True)


def test_version_prints_package_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"mxlaunch {__version__}"


def test_unknown_option_is_usage_error_without_traceback() -> None:
    result = run_cli("--no-such-flag")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "no-such-flag" in result.stderr
