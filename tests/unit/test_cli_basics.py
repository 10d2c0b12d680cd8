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


def test_event_lines_for_people_hold_plain_values_only() -> None:
    """Nested detail is JSON's (--json); a person's line never shows a Python repr."""
    from mxlaunch.cli.common import plain_fields

    fields = {"rank": 0, "bytes": 327680, "seconds": 0.16, "gpu": {"mode": "auto", "pin_wait_seconds": 0.0},
              "prepared": {"prepare_seconds": 1.05}, "ranks": [0, 1], "new": [{"path": "a"}], "published": False,
              "reason": "nothing new compiled", "unmanaged": [], "dir": "", "argv": ["vllm", "serve"], "key": None}
    line = plain_fields(fields, skip=("argv",))
    assert line == "rank=0 bytes=327680 seconds=0.16 ranks=0,1 published=no reason=nothing new compiled"
    assert "{" not in line and "[" not in line


COMMANDS = ("", "launch", "stage", "doctor", "profile", "verify", "bench", "store list", "store verify", "store rm",
            "store prune", "peers", "cache list", "cache rm")


def test_help_texts_show_their_bracketed_defaults_and_no_stray_punctuation() -> None:
    import re

    for command in COMMANDS:
        result = subprocess.run([sys.executable, "-m", "mxlaunch.cli", *command.split(), "--help"], capture_output=True,
                                text=True, env={**__import__("os").environ, "COLUMNS": "200"})
        assert result.returncode == 0, (command, result.stderr)
        assert not re.search(r"\s\.(\s|$)", result.stdout), (command, result.stdout)  # a markup tag eaten: "root ."
    launch = subprocess.run([sys.executable, "-m", "mxlaunch.cli", "launch", "--help"], capture_output=True, text=True,
                            env={**__import__("os").environ, "COLUMNS": "200"}).stdout
    launch = " ".join(launch.split())  # as wrapped to the terminal's width
    assert "Where the engine log goes [default: ~/.cache/mxlaunch/runs/<run>]." in launch
    assert "[env MXLAUNCH_REGISTRY]" in launch
