"""Command-line interface: options in, rich tables / progress / JSON out, errors to exit codes.

No logic lives here; each command calls into its module and renders the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from mxlaunch import __version__
from mxlaunch.errors import EXIT_USAGE, MxlaunchError

app = typer.Typer(
    name="mxlaunch",
    help="Fast, verified cold starts for SGLang and vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()
err = Console(stderr=True)


def print_json(payload: dict) -> None:
    """Every --json output carries schema 1 and goes to stdout, alone."""
    payload = {"schema": 1, **payload}
    sys.stdout.write(json.dumps(payload, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"mxlaunch {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Fast, verified cold starts for SGLang and vLLM."""


# ---- commands are registered below, one block each --------------------------------------------


def main() -> None:
    """Console entry point: run the app and turn our errors into one line + exit code."""
    try:
        app(standalone_mode=False)
    except MxlaunchError as exc:
        err.print(f"[bold red]error:[/] {exc.one_line()}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as exc:
        # Click's usage errors (typer vendors click, so match by shape, not by class).
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            err.print(f"[bold red]error:[/] {exc.format_message()} — see `mxlaunch --help`", highlight=False)
            sys.exit(EXIT_USAGE)
        raise


if __name__ == "__main__":
    main()
