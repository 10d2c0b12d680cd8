"""The launch command's remote model, fetched before the plan: the launcher reads the engine's command
(engines/) and hands the download layer (remote/) a ModelRequest — what to fetch and whether the engine
downloads it itself — then rewrites the command to name the local folder an S3 model landed in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from mxlaunch.engines.environment import hub_cache_dir, is_hub_id
from mxlaunch.engines.registry import engine_for
from mxlaunch.errors import MxlaunchError
from mxlaunch.remote import s3
from mxlaunch.remote.fetch import Emit, Fetched, ModelRequest, download_request
from mxlaunch.remote.localize import fetch_model
from mxlaunch.store.core import Store

RUNAI = ("runai_streamer", "runai_streamer_sharded", "--load-format=runai_streamer", "--load-format=runai_streamer_sharded")
MODELSCOPE = ("VLLM_USE_MODELSCOPE", "SGLANG_USE_MODELSCOPE")


def model_request(argv: list[str], environ: Mapping[str, str] = os.environ) -> Optional[ModelRequest]:
    """What the command's model asks of the download layer; None for a bad command (the planner says what is
    wrong with it, as without a remote model)."""
    try:
        spec = engine_for(argv).parse(argv, engine_version=None)
    except MxlaunchError:
        return None
    if s3.is_s3_url(spec.model):
        streams = any(a in RUNAI for a in argv)
        return ModelRequest(spec.model, engine_fetches="the engine streams the model from S3 itself (runai_streamer)"
                            if streams else "")
    why = ""
    if any(environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in MODELSCOPE):
        why = "the engine reads models from ModelScope: it downloads the model itself"
    elif any(a == "--download-dir" or a.startswith("--download-dir=") for a in argv):
        why = "--download-dir names the engine's own cache folder: the engine downloads the model itself"
    return ModelRequest(spec.model, spec.revision, hub_id=spec.model_path is None and is_hub_id(spec.model),
                        cache=hub_cache_dir(environ), engine_fetches=why)


def download_for_command(argv: list[str], store: Store, emit: Emit, environ: Mapping[str, str] = os.environ,
                         **kw: object) -> Optional[Fetched]:
    """The command's model, when it is a hub id not in the hub cache, downloaded once per store (remote/fetch.py's
    download_request); None when there is nothing to do: a local folder, a hub id already cached, HF_HUB_OFFLINE,
    ModelScope, or `--download-dir` (the engine's own cache folder, which the planner does not read)."""
    request = model_request(argv, environ)
    return None if request is None else download_request(request, store, emit, environ, **kw)


def localize_command(argv: list[str], store: Store, emit: Emit, environ: Mapping[str, str] = os.environ,
                     **kw: object) -> list[str]:
    """Before the launch plans: the command to plan. A model given as s3://bucket/path is downloaded once per
    store and the command names the local folder (except through vLLM's runai_streamer, which reads S3 itself);
    a hub id not in the hub cache is downloaded into it (the command stays: the engine finds it there)."""
    request = model_request(argv, environ)
    if request is None:
        return argv
    folder = fetch_model(request, store, emit, environ, **kw)
    return argv if folder is None else localized_argv(argv, request.model, folder)


def localized_argv(argv: list[str], url: str, folder: Path) -> list[str]:
    """The command with the S3 URL replaced by the local folder (as a value or `--flag=URL`); the API keeps
    serving the model under the URL's name (`--served-model-name`, unless the command sets one)."""
    out = []
    for a in argv:
        if a == url:
            out.append(str(folder))
        elif a.startswith("--") and a.endswith("=" + url):
            out.append(a[: -len(url)] + str(folder))
        else:
            out.append(a)
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in argv):
        out += ["--served-model-name", url]
    return out
