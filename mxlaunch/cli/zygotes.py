"""`mxlaunch zygotes`: the warm interpreters `launch --zygote` left on this node (registered by cli/app.py)."""

from __future__ import annotations

import typer
from rich.markup import escape

from mxlaunch.cli.common import json_option, out, print_json


def zygotes(
    stop: bool = typer.Option(False, "--stop", help="Stop them all (and forget refusals): each exits within 2 s."),
    as_json: bool = json_option("Print them as JSON."),
) -> None:
    """This user's warm engine interpreters on this node: waiting, refused (and why), or left by a dead one (docs/launch.md)."""
    from mxlaunch.launch.zygote import list_zygotes, stop_zygotes, zygote_root

    found = list_zygotes()
    stopped = stop_zygotes() if stop else []
    if as_json:
        print_json({"root": str(zygote_root()), "zygotes": [z.to_json() for z in found], "stopped": stopped})
        return
    if not found:
        out.print(f"no zygotes in {escape(str(zygote_root()))}", highlight=False)
        return
    for z in found:
        age = f" · up {z.age_s:.0f} s" if z.age_s is not None else ""
        what = escape(z.reason) if z.status == "refused" else escape(z.entry or "?") + (f" · pid {z.pid}" if z.pid else "") + age
        out.print(f"{z.key} [bold]{z.status}[/]: {what}", highlight=False)
    if stopped:
        out.print(f"stopped {len(stopped)}", highlight=False)
