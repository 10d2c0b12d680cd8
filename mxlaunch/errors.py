"""Errors that map to the exit-code contract shared by every command.

0 ok · 1 the check/run failed · 2 usage or input error. The CLI turns these into a
one-line message (problem + fix) and the exit code; nothing else should print tracebacks.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class MxlaunchError(Exception):
    """Base class: carries the exit code and a one-line, actionable message."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def one_line(self) -> str:
        return f"{self.message} — {self.fix}" if self.fix else self.message


class UsageError(MxlaunchError):
    """Bad flags, unreadable input, unreachable server: exit 2."""

    exit_code = EXIT_USAGE


class CheckFailed(MxlaunchError):
    """The thing ran but failed its check (mismatch, not ready, copy failed): exit 1."""

    exit_code = EXIT_FAILED
