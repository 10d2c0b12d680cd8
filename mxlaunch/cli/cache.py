"""`mxlaunch cache list/rm`: the JIT kernel caches in the artifact store (registered by cli/app.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from mxlaunch.cli.common import artifact_path_option, json_option, out, print_json

cache_app = typer.Typer(
    rich_markup_mode=None,  # help texts are plain: "[default: ...]" is text, not a markup tag
    help="See and remove the JIT kernel caches in the artifact store (docs/kernel-cache.md).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _caches(artifact_path: Optional[Path]):  # noqa: ANN202 — a KernelCacheStore (imported lazily)
    from mxlaunch.kernelcache.archive import KernelCacheStore
    from mxlaunch.store.opener import open_store

    store = open_store(artifact_path)
    return KernelCacheStore(store.root, store.coordinator)


@cache_app.command("list")
def cache_list(
    artifact_path: Optional[Path] = artifact_path_option(),
    as_json: bool = json_option("Print the caches as JSON (every key field included)."),
) -> None:
    """Every kernel cache: key, engine and version, model, size, date (ok, or why it would be a miss)."""
    from rich.table import Table

    from mxlaunch.staging.capacity import format_bytes
    from mxlaunch.store.snapshot import model_name

    caches = _caches(artifact_path)
    entries = caches.list()
    if as_json:
        print_json({"root": str(caches.root), "caches": [e.to_dict() for e in entries]})
        return
    table = Table(title=f"kernel caches in {escape(str(caches.root))}", box=None, pad_edge=False, padding=(0, 1, 0, 0),
                  title_justify="left", header_style="bold underline")
    for col in ("key", "engine", "model", "size", "created", "status"):
        table.add_column(col, justify="right" if col == "size" else "left", overflow="fold",
                         no_wrap=col in ("key", "size", "created"), min_width={"model": 10}.get(col))
    for e in entries:
        d = e.to_dict()
        engine = " ".join(str(x) for x in (d["engine"], d["engine_version"]) if x) or "-"
        size = format_bytes(d["bytes"]) if isinstance(d["bytes"], int) else "-"
        status = "[green]ok[/]" if e.ok else "[red]refused[/]"
        table.add_row(e.key, escape(engine), escape(str(model_name(d["model"]) or "-")), size, str(d["created_at"] or "-")[:10], status)
    out.print(table)
    for e in entries:
        if not e.ok:
            out.print(f"{e.key}: {escape(e.reason)}", highlight=False, soft_wrap=True)


@cache_app.command("rm")
def cache_rm(
    key: Optional[str] = typer.Argument(None, help="Cache key (see `mxlaunch cache list`).", show_default=False),
    remove_all: bool = typer.Option(False, "--all", help="Remove every kernel cache in the store."),
    artifact_path: Optional[Path] = artifact_path_option(),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Remove one kernel cache (KEY) or all of them (--all); the next launch compiles and captures again."""
    from mxlaunch.errors import UsageError
    from mxlaunch.kernelcache.tarball import ArchiveRefused

    if (key is None) == (not remove_all):
        raise UsageError("pass exactly one of KEY or --all", "see `mxlaunch cache list` for the keys")
    caches = _caches(artifact_path)
    keys = [e.key for e in caches.list()] if remove_all else [key]
    for k in keys:
        try:
            caches.remove(k)
        except (FileNotFoundError, ArchiveRefused) as exc:  # not there, or not a key at all
            raise UsageError(f"no kernel cache {k} in {caches.root}", "see `mxlaunch cache list`") from exc
        except OSError as exc:
            raise UsageError(f"cannot remove kernel cache {k}: {exc.strerror or exc}", "check the store's permissions") from exc
    if as_json:
        print_json({"removed": keys, "root": str(caches.root)})
    else:
        out.print(f"removed {len(keys)} kernel cache(s) from {escape(str(caches.root))}", highlight=False)
