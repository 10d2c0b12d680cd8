"""`mxlaunch store list/verify/rm/prune`: the artifact store's snapshots (registered by cli/app.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from mxlaunch.cli.common import artifact_path_option, err, json_option, out, print_json

# ---- store: list / verify / rm snapshots in the artifact store (issue 3) ----

store_app = typer.Typer(
    rich_markup_mode=None,  # help texts are plain: "[default: ...]" is text, not a markup tag
    help="See, check and remove snapshots in the artifact store.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@store_app.command("list")
def store_list(
    artifact_path: Optional[Path] = artifact_path_option(),
    as_json: bool = json_option("Print the snapshots as JSON."),
) -> None:
    """Every snapshot in the store: model, engine, parallelism, size, created, status (ok/incomplete/claimed/refused).

    --json has every field, the model's full path and the snapshot's rank count included."""
    from rich.table import Table

    from mxlaunch.staging.capacity import format_bytes
    from mxlaunch.store.opener import open_store

    from mxlaunch.store.prune import warm_images

    store = open_store(artifact_path)
    entries = store.list()
    where = getattr(store, "url", store.root)  # an S3 store (store/s3_store.py) by its URL
    images = [] if getattr(store, "remote", False) else warm_images(store)  # an S3 store keeps none (docs/launch.md)
    if as_json:
        print_json({"root": str(where), "snapshots": [e.to_dict() for e in entries],
                    "images": [{k: v for k, v in i.to_dict().items() if k in ("kind", "name", "path", "bytes", "last_used")}
                               for i in images]})
        return
    # Readable at 80 columns: no borders, one space between columns, the model by name (the path is in
    # --json), the date without the time; only the model may wrap.
    table = Table(title=f"snapshots in {escape(str(where))}", box=None, pad_edge=False, padding=(0, 1, 0, 0),
                  title_justify="left", header_style="bold underline")
    for col in ("id", "model", "engine", "tp/pp", "size", "created", "status"):
        table.add_column(col, justify="right" if col == "size" else "left", overflow="fold",
                         no_wrap=col in ("id", "engine", "size", "created"), min_width={"model": 12, "status": 6}.get(col))
    style = {"ok": "green", "claimed": "cyan", "incomplete": "yellow", "refused": "red"}
    for e in entries:
        d = e.to_dict()
        engine = " ".join(str(x) for x in (d["engine"], d["engine_version"]) if x) or "-"
        tp_pp = f"{d['tp'] or '-'}/{d['pp'] or '-'}" if d["tp"] or d["pp"] else "-"
        status = f"[{style.get(e.status, 'white')}]{e.status}[/]"
        if e.status == "claimed" and e.holder is not None:
            status += f" ({escape(e.holder.describe())})"
        table.add_row(e.source_id, escape(str(d["model_name"] or "-")), escape(engine), tp_pp, format_bytes(e.bytes), str(d["created_at"] or "-")[:10], status)
    out.print(table)
    for e in entries:
        if e.status == "refused":
            out.print(f"{e.source_id}: {escape(e.reason)}", highlight=False, soft_wrap=True)
    if images:  # warm start-up state of this user's (launch --zygote, --engine-snapshot): what `store prune` ages too
        shown = Table(title="your zygote images and engine snapshots", box=None, pad_edge=False, padding=(0, 1, 0, 0),
                      title_justify="left", header_style="bold underline")
        for col in ("kind", "key", "size", "last used"):
            shown.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
        for i in images:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.last_used)) if i.last_used else "-"
            shown.add_row(i.kind, i.name, format_bytes(i.bytes), used)
        out.print(shown)


@store_app.command("verify")
def store_verify(
    source_id: str = typer.Argument(..., help="Snapshot id (see `mxlaunch store list`)."),
    artifact_path: Optional[Path] = artifact_path_option(),
    quick: bool = typer.Option(False, "--quick", help="Check manifest, paths and sizes only (no checksums)."),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Check a snapshot: manifest, ranks, paths inside the store, sizes and xxh3_128 checksums (exit 1 on failure)."""
    from mxlaunch.errors import CheckFailed, UsageError
    from mxlaunch.staging.capacity import format_bytes
    from mxlaunch.store.opener import open_store

    store = open_store(artifact_path)
    if not store.exists(source_id):
        raise UsageError(f"no snapshot {source_id} in {getattr(store, 'url', store.root)}", "see `mxlaunch store list`")
    with err.status(f"verifying {source_id}"):
        report = store.verify(source_id, full=not quick)
    if as_json:
        print_json(report.to_dict())
    elif report.ok:
        out.print(f"{source_id}: ok — {report.files} files, {format_bytes(report.bytes)}"
                  f"{', checksums match' if report.full else ' (sizes only)'}", highlight=False)
    else:
        for problem in report.problems:
            out.print(f"{source_id}: {escape(problem)}", highlight=False, soft_wrap=True)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise CheckFailed(f"snapshot {source_id} failed verification: {report.problems[0]}{more}",
                          f"remove it with `mxlaunch store rm {source_id}`; the next launch captures it again")


@store_app.command("rm")
def store_rm(
    source_id: str = typer.Argument(..., help="Snapshot id (see `mxlaunch store list`)."),
    artifact_path: Optional[Path] = artifact_path_option(),
    force: bool = typer.Option(False, "--force", help="Remove it even while a capture claims it."),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Remove a snapshot (refused while a capture holds its claim, unless --force)."""
    from mxlaunch.store.opener import open_store

    store = open_store(artifact_path)
    store.remove(source_id, force=force)
    if as_json:
        print_json({"removed": source_id, "root": str(getattr(store, "url", store.root))})
    else:
        out.print(f"removed {source_id} from {escape(str(getattr(store, 'url', store.root)))}", highlight=False)


@store_app.command("prune")
def store_prune(
    artifact_path: Optional[Path] = artifact_path_option(),
    unused_for: Optional[str] = typer.Option(
        None, "--unused-for", metavar="AGE",
        help="Also remove snapshots and kernel caches no launch has used for AGE (e.g. 30d, 12h)."),
    max_size: Optional[str] = typer.Option(
        None, "--max-size", metavar="SIZE",
        help="Then remove the least recently used ones until the store fits in SIZE (e.g. 2TiB, 500GiB)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would go; change nothing."),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Remove what no launch can use any more (unpublished captures whose claim is over, what interrupted removals left) and, with --unused-for / --max-size, what no launch has used lately.

    Nothing a capture holds the claim of is touched (it is listed as kept). Every launch that stages or pulls a snapshot, or restores a kernel cache, stamps its last use."""
    from rich.table import Table

    from mxlaunch.errors import UsageError
    from mxlaunch.staging.capacity import format_bytes, parse_size
    from mxlaunch.store.opener import open_store
    from mxlaunch.store.prune import parse_duration, prune

    try:
        age = parse_duration(unused_for) if unused_for is not None else None
    except ValueError as exc:
        raise UsageError(f"--unused-for: {exc}", "pass an age such as 30d, 12h or 90m") from exc
    try:
        limit = parse_size(max_size) if max_size is not None else None
    except ValueError as exc:
        raise UsageError(f"--max-size: {exc}", "pass a size such as 2TiB or 500GiB") from exc
    store = open_store(artifact_path)
    if getattr(store, "remote", False):  # an S3 store: the same rules on its objects (store/s3_prune.py)
        with err.status(f"{'looking through' if dry_run else 'pruning'} {store.url}"):
            report = store.prune(unused_for=age, max_bytes=limit, dry_run=dry_run)
    elif not store.root.is_dir():
        raise UsageError(f"no artifact store at {store.root}", "pass --artifact-path DIR (or set MXLAUNCH_ARTIFACT_PATH)")
    else:
        with err.status(f"{'looking through' if dry_run else 'pruning'} {store.root}"):
            report = prune(store, unused_for=age, max_bytes=limit, dry_run=dry_run)
    if as_json:
        print_json(report.to_dict())
        return
    verb = "would remove" if dry_run else "removed"
    if report.items:
        table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold underline")
        for col in ("kind", "name", "size", "why"):
            table.add_column(col, justify="right" if col == "size" else "left", overflow="fold",
                             no_wrap=col in ("kind", "size"))
        for item in report.items:
            why = f"[yellow]kept: {escape(item.skipped)}[/]" if item.skipped else escape(item.why)
            table.add_row(item.kind, escape(item.name), format_bytes(item.bytes), why)
        out.print(table)
    peers = f" and {report.stale_peer_records} stale P2P record(s)" if report.stale_peer_records else ""
    out.print(f"{verb} {len(report.removed)} item(s), {format_bytes(report.freed)} of "
              f"{format_bytes(report.bytes_before)} in {escape(str(report.root))}{peers}", highlight=False)
