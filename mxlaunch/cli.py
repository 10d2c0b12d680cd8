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


@app.command()
def stage(
    sources: List[str] = typer.Argument(..., help="Files, directories or globs to copy.", show_default=False),
    dest: Path = typer.Option(..., "--dest", "-d", help="Destination folder (e.g. /dev/shm/...)."),
    readers: Optional[int] = typer.Option(None, "--readers", "-j", help="Parallel reader threads [default: 4×cores, 16–64]."),
    chunk_size: str = typer.Option("16MiB", "--chunk-size", help="Bytes per read request (multiple of 4 KiB)."),
    manifest: Optional[Path] = typer.Option(None, "--manifest", help="Check each copy against this manifest (path → bytes, xxh3_128)."),
    write_manifest_to: Optional[Path] = typer.Option(None, "--write-manifest", help="Write a manifest of the copies here."),
    verify: bool = typer.Option(False, "--verify", help="Re-read each source and compare checksums with its copy."),
    rate_limit: Optional[str] = typer.Option(None, "--rate-limit", help="Cap total read rate, e.g. 2GiB (per second)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace destination files that exist."),
    no_direct: bool = typer.Option(False, "--no-direct", help="Use buffered reads (skip O_DIRECT)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    """Copy files into DEST with parallel O_DIRECT reads; each file appears (by rename) when complete."""
    from mxlaunch.errors import UsageError
    from mxlaunch.progress import byte_progress
    from mxlaunch.stage import StageRequest, default_readers, plan_items, run_stage
    from mxlaunch.staging.capacity import format_bytes, parse_size

    try:
        chunk = parse_size(chunk_size)
        rate = float(parse_size(rate_limit)) if rate_limit else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    request = StageRequest(
        sources=sources, dest=dest, readers=readers or default_readers(), chunk_size=chunk,
        manifest=manifest, write_manifest=write_manifest_to, verify=verify, rate_limit=rate,
        overwrite=overwrite, use_o_direct=not no_direct,
    )
    items, layouts = plan_items(request)
    total = sum(item.size for item in items)
    with byte_progress(err, total, "staging", enabled=not as_json) as advance:
        result = run_stage(request, items, layouts, on_progress=advance)
    if not result.o_direct and not no_direct:
        err.print("note: the source filesystem refused O_DIRECT for some files; those used buffered reads")
    if as_json:
        print_json({
            "files": [{"src": str(f.src), "dest": str(f.dest), "bytes": f.bytes} for f in result.files],
            "bytes": result.bytes,
            "seconds": round(result.seconds, 6),
            "gib_per_s": round(result.gib_per_s, 4),
            "readers": result.readers,
            "o_direct": result.o_direct,
        })
    else:
        err.print(
            f"staged {len(result.files)} files, {format_bytes(result.bytes)} in {result.seconds:.2f} s "
            f"({result.gib_per_s:.2f} GiB/s, {result.readers} readers, O_DIRECT {'on' if result.o_direct else 'off'})"
        )


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
