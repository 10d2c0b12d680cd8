"""A launch's remote model fetched before it plans (a hub id into the hub cache, an S3 folder into the store),
once per artifact store. Its own module: it uses both fetchers (remote/fetch.py, remote/s3.py). It is handed a
ModelRequest (launch/model_fetch.py builds it from the engine's command), never the command itself."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from mxlaunch.remote import s3
from mxlaunch.remote.fetch import Emit, ModelRequest, download_request
from mxlaunch.store.core import Store


def fetch_model(request: ModelRequest, store: Store, emit: Emit, environ: Mapping[str, str] = os.environ,
                **kw: object) -> Optional[Path]:
    """The local folder the engine should read instead of the request's model, or None when it reads the model
    as named. A model given as s3://bucket/path is downloaded once per store (the engine reads no S3 itself,
    unless the request says it streams it); a hub id not in the hub cache is downloaded into it (the engine
    finds it there)."""
    if s3.is_s3_url(request.model):
        if request.engine_fetches:
            emit("download", status="off", model=request.model, message=request.engine_fetches)
            return None
        got = s3.ensure_model(request.model, store, emit, environ=environ, **kw)  # type: ignore[arg-type]
        emit("model", source=request.model, dir=str(got.path), by=got.by, version=got.commit,
             message=f"{request.model} is served from {got.path}")
        return got.path
    download_request(request, store, emit, environ, **kw)
    return None
