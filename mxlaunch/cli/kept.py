"""`mxlaunch kept`: the staged snapshots `launch --keep-staged` left in /dev/shm on this node (registered by cli/app.py)."""

from __future__ import annotations

import typer
from rich.markup import escape

from mxlaunch.cli.common import json_option, out, print_json


def kept(
    drop: bool = typer.Option(False, "--drop", help="Drop them all: their RAM is freed once no running launch links "
                              "their files (a running one keeps its own links until it stops)."),
    as_json: bool = json_option("Print them as JSON."),
) -> None:
    """This user's staged snapshots kept in /dev/shm for the next launch of the same snapshot on this node
    (`launch --keep-staged`): source id, size, files, last use (docs/stage.md)."""
    from mxlaunch.launch.cleanup import user_roots
    from mxlaunch.staging import kept as kept_stage
    from mxlaunch.staging.capacity import format_bytes

    found = [(root, e) for root in user_roots() for e in kept_stage.entries(root)]
    if drop:
        for root, e in found:
            kept_stage.drop(root, e.source_id)
    if as_json:
        print_json({"kept": [{"source_id": e.source_id, "bytes": e.bytes, "files": e.files, "last_used": e.last_used,
                              "path": str(kept_stage.kept_root(root) / e.source_id)} for root, e in found],
                    "dropped": [e.source_id for _, e in found] if drop else []})
        return
    if not found:
        out.print("no staged snapshots kept in /dev/shm (launch --keep-staged keeps them)", highlight=False)
        return
    for root, e in found:
        out.print(f"{e.source_id} [bold]kept[/]: {format_bytes(e.bytes)} in {e.files} file(s) · last used "
                  f"{kept_stage.age_s(e):.0f} s ago · {escape(str(kept_stage.kept_root(root) / e.source_id))}", highlight=False)
    if drop:
        out.print(f"dropped {len(found)}", highlight=False)
