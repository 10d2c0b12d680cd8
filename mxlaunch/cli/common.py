"""What every CLI command shares: the consoles, the --json and --artifact-path options, JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console

from mxlaunch import settings

out = Console()
err = Console(stderr=True, soft_wrap=True)  # one-line errors must never wrap


# ---- options several commands share: one definition each ----

_ARTIFACT_PATH_HELP = f"Artifact store root [default: ${settings.ARTIFACT_PATH}, else ~/.cache/mxlaunch/store]."


def json_option(help: str = "Print the result as JSON on stdout.") -> Any:
    """--json: one JSON document (or JSON lines) on stdout, always with "schema": 1."""
    return typer.Option(False, "--json", help=help)


def artifact_path_option() -> Any:
    """--artifact-path, defaulting to $MXLAUNCH_ARTIFACT_PATH (the store falls back to the user cache)."""
    return typer.Option(None, "--artifact-path", envvar=settings.ARTIFACT_PATH, help=_ARTIFACT_PATH_HELP)


def plain_fields(fields: dict, skip: tuple = ()) -> str:
    """`key=value ...` for people: numbers, words and lists of them only. Nested detail (dicts, lists of
    dicts) is left to --json, where it is proper JSON; empty values are left out."""
    parts = []
    for key, value in fields.items():
        if key in skip or value is None or value in ([], "", {}) or isinstance(value, dict):
            continue
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                continue
            value = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        parts.append(f"{key}={value}")
    return " ".join(parts)


def print_json(payload: dict) -> None:
    """Every --json output carries schema 1 and goes to stdout, alone."""
    payload = {"schema": 1, **payload}
    sys.stdout.write(json.dumps(payload, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()
