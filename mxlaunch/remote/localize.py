"""The command a launch plans: its remote model fetched first (a hub id into the hub cache, an S3 folder into
the store), once per artifact store. Its own module: it uses both fetchers (remote/fetch.py, remote/s3.py)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

from mxlaunch.errors import MxlaunchError
from mxlaunch.remote import s3
from mxlaunch.remote.fetch import Emit, download_for_command
from mxlaunch.store.core import Store


def localize_command(argv: list[str], store: Store, emit: Emit, environ: Mapping[str, str] = os.environ,
                     **kw: object) -> list[str]:
    """Before the launch plans: the command to plan. A model given as s3://bucket/path is downloaded once per
    store and the command names the local folder (the engine reads no S3 itself, except through vLLM's
    runai_streamer, which is left to it); a hub id not in the hub cache is downloaded into it (the command
    stays: the engine finds it there)."""
    model = _command_model(argv)
    if model is not None and s3.is_s3_url(model):
        if any(a in ("runai_streamer", "runai_streamer_sharded", "--load-format=runai_streamer",
                     "--load-format=runai_streamer_sharded") for a in argv):
            emit("download", status="off", model=model, message="the engine streams the model from S3 itself (runai_streamer)")
            return argv
        got = s3.ensure_model(model, store, emit, environ=environ, **kw)  # type: ignore[arg-type]
        emit("model", source=model, dir=str(got.path), by=got.by, version=got.commit,
             message=f"{model} is served from {got.path}")
        return s3.localized_argv(argv, model, got.path)
    download_for_command(argv, store, emit, environ, **kw)
    return argv


def _command_model(argv: list[str]) -> Optional[str]:
    from mxlaunch.engines.registry import engine_for

    try:
        return engine_for(argv).parse(argv, engine_version=None).model
    except MxlaunchError:
        return None  # a bad command: the planner says what is wrong with it
