"""`mxlaunch peers`: the P2P sources in the registry, live and stale (registered by cli/app.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from mxlaunch import settings
from mxlaunch.cli.common import artifact_path_option, json_option, out, print_json

_REGISTRY_HELP = "Peer registry: file (the artifact store's .peers folder; the default), file:/dir or redis://host:port/db."


def _age(seconds: float) -> str:
    """Time since the last heartbeat, short: 0.4 s, 12 s, 3 min, 5 h."""
    if seconds < 120:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.0f} h"


def peers(
    artifact_path: Optional[Path] = artifact_path_option(),
    registry: Optional[str] = typer.Option(None, "--registry", envvar=settings.REGISTRY, help=_REGISTRY_HELP),
    source_id: Optional[str] = typer.Option(None, "--source-id", help="Only this source id."),
    reap: bool = typer.Option(False, "--reap", help="First remove stale records (stale longer than --grace)."),
    grace: float = typer.Option(0.0, "--grace", min=0.0, help="With --reap: seconds a record must have been stale."),
    verify: bool = typer.Option(False, "--verify", help="Ask every live source to recompute its checksums "
                                "(answered at its next heartbeat); exit 1 unless all match."),
    timeout: float = typer.Option(30.0, "--timeout", min=1.0, help="With --verify: seconds to wait for the answers."),
    as_json: bool = json_option("Print the sources as JSON."),
) -> None:
    """Engine workers that publish their weights for P2P transfer: who, where, live or stale (docs/p2p.md)."""
    from rich.table import Table

    from mxlaunch.coord.peers import open_registry, redact_url
    from mxlaunch.staging.capacity import format_bytes

    reg = open_registry(registry, artifact_path)
    where = redact_url(reg.url)
    reaped = reg.reap(grace_s=grace) if reap else None
    entries = reg.sources(source_id, include_stale=True) if source_id else reg.all_sources(include_stale=True)
    refused = list(getattr(reg, "refusals", []))
    verified = None
    if verify:
        from mxlaunch.coord.peers_verify import verify_sources

        verified = verify_sources(reg, [e for e in entries if e.state == "live"], timeout_s=timeout)
    if as_json:
        payload = {"registry": where, "sources": [e.to_json() for e in entries], "refused": refused}
        if reaped is not None:
            payload["reaped"] = reaped
        if verified is not None:
            payload["verified"] = verified
        print_json(payload)
        _verify_exit(verified)
        return
    if not entries:
        out.print(f"no sources in {escape(where)}", highlight=False)
    # One table per source id (ids are 16 characters: the rest of a row fits 80 columns beside them only so).
    by_source: dict[str, list] = {}
    for e in entries:
        by_source.setdefault(e.record.source_id, []).append(e)
    for sid, group in sorted(by_source.items()):
        live = sum(e.state == "live" for e in group)
        table = Table(title=f"source {sid} in {escape(where)}: {live} live, {len(group) - live} stale", box=None,
                      pad_edge=False, padding=(0, 1, 0, 0), title_justify="left", header_style="bold underline")
        for col in ("rank", "layout", "dev", "host", "pid", "worker", "state", "beat", "tensors", "size"):
            table.add_column(col, justify="right" if col in ("pid", "beat", "tensors", "size") else "left",
                             overflow="fold", no_wrap=col not in ("host", "worker"))
        for e in sorted(group, key=lambda e: (e.record.rank, e.state != "live", -e.heartbeat_at)):
            r = e.record
            state = "[green]live[/]" if e.state == "live" else "[yellow]stale[/]"
            table.add_row(f"{r.rank}/{r.world}", r.layout, r.device, escape(r.host), str(r.pid), escape(r.worker),
                          state, _age(e.age_s), str(len(r.tensors)), format_bytes(r.total_bytes))
        out.print(table)
    if reaped is not None:
        out.print(f"reaped {reaped} stale record{'' if reaped == 1 else 's'}", highlight=False)
    for line in refused:
        out.print(f"[yellow]refused[/] {escape(line)}", highlight=False)
    for v in verified or []:
        what = "[green]its bytes match the checksums it published[/]" if v["ok"] else (
            f"[red]{escape(v.get('error') or str(len(v['bad'])) + ' tensor(s) changed: ' + ', '.join(v['bad'][:3]))}[/]")
        out.print(f"verify {escape(v['worker'])} (rank {v['rank']}): {what}", highlight=False)
    _verify_exit(verified)


def _verify_exit(verified: Optional[list]) -> None:
    """--verify: exit 1 (the check failed) unless every live source answered that its bytes match."""
    if verified is not None and not all(v["ok"] for v in verified):
        raise typer.Exit(1)
