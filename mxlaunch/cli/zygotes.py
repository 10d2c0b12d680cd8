"""`mxlaunch zygotes`: the warm interpreters `launch --zygote` left on this node (registered by cli/app.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from mxlaunch.cli.common import artifact_path_option, json_option, out, print_json


def zygotes(
    stop: bool = typer.Option(False, "--stop", help="Stop them all (and forget refusals): each exits within 2 s. "
                              "Their CRIU images stay in the store (`store prune` removes unused ones)."),
    artifact_path: Optional[Path] = artifact_path_option(),
    as_json: bool = json_option("Print them as JSON."),
) -> None:
    """This user's warm engine interpreters on this node: waiting, refused (and why), or left by a dead one; and
    their CRIU images in the store, which a node's first `launch --zygote` restores (docs/launch.md)."""
    from mxlaunch.warmstart.zygote import list_zygotes, stop_zygotes, zygote_root
    from mxlaunch.store.zygote_images import list_images
    from mxlaunch.store.opener import open_store

    found = list_zygotes()
    stopped = stop_zygotes() if stop else []
    images = list_images(open_store(artifact_path).root)
    if as_json:
        print_json({"root": str(zygote_root()), "zygotes": [z.to_json() for z in found], "stopped": stopped,
                    "images": images})
        return
    for image in images:
        used = f" · last used {time.time() - image['last_used']:.0f} s ago" if image["last_used"] else ""
        size = f"{image['bytes'] / 2**20:.0f} MiB" if image["bytes"] else "? MiB"
        out.print(f"{image['key']} [bold]image[/]: {size}{used} · {escape(image['path'])}", highlight=False)
    if not found:
        out.print(f"no zygotes in {escape(str(zygote_root()))}", highlight=False)
        return
    for z in found:
        age = f" · up {z.age_s:.0f} s" if z.age_s is not None else ""
        what = escape(z.reason) if z.status == "refused" else escape(z.entry or "?") + (f" · pid {z.pid}" if z.pid else "") + age
        out.print(f"{z.key} [bold]{z.status}[/]: {what}", highlight=False)
    if stopped:
        out.print(f"stopped {len(stopped)}", highlight=False)
