"""`mxlaunch pull`: a hub id into the hub cache, or an s3:// model folder into the store's model folder,
downloaded once per artifact store (registered by cli/app.py).

`launch` does the same by itself for a hub id that is not in the cache; `pull` is for a job script's
step before the engines start, or for a login node that can reach the hub when compute nodes cannot."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from mxlaunch.cli.common import artifact_path_option, err, json_option, out, plain_fields, print_json


def pull(
    model: str = typer.Argument(..., help="A hub id (org/name) or an s3://bucket/path folder, as the engine command "
                                "names it.", show_default=False),
    revision: Optional[str] = typer.Option(None, "--revision", help="A branch, tag or commit [default: main]."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="The hub cache [default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub]."),
    workers: int = typer.Option(16, "--workers", "-j", help="Parallel ranged GETs."),
    artifact_path: Optional[Path] = artifact_path_option(),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Download a hub or S3 model once per artifact store: one launcher downloads, the others wait and reuse it."""
    from mxlaunch.errors import UsageError
    from mxlaunch.remote import hub
    from mxlaunch.remote.fetch import ensure_model
    from mxlaunch.store.opener import open_store

    if workers < 1:
        raise UsageError(f"--workers {workers} must be at least 1", "give a positive number of parallel GETs")
    from mxlaunch.remote import s3

    if not s3.is_s3_url(model) and hub.offline():
        raise UsageError(f"HF_HUB_OFFLINE is set: {model} cannot be downloaded", "unset HF_HUB_OFFLINE to download it")
    if s3.is_s3_url(model) and (revision or cache_dir):
        raise UsageError("--revision and --cache-dir are for hub ids", "drop them for an s3:// model (its listing is its version)")

    def emit(event: str, **fields: object) -> None:
        if not as_json:
            err.print(f"[bold cyan]mxlaunch[/] {event}: {escape(plain_fields(fields))}", highlight=False)

    if s3.is_s3_url(model):
        got = s3.ensure_model(model, open_store(artifact_path), emit, workers=workers)
    else:
        from mxlaunch.engines.environment import hub_cache_dir

        got = ensure_model(model, revision, open_store(artifact_path), emit, cache=cache_dir or hub_cache_dir(),
                           workers=workers)
    if as_json:
        print_json({"model": model, "path": str(got.path), "commit": got.commit, "by": got.by,
                    "bytes": got.bytes, "seconds": round(got.seconds, 3)})
        return
    how = {"here": f"downloaded {got.bytes / (1 << 20):.1f} MiB", "other": "downloaded by another launcher",
           "cached": "already in the cache"}[got.by]
    out.print(f"{escape(model)}@{got.commit[:12]} {how}: {escape(str(got.path))}", highlight=False, soft_wrap=True)
