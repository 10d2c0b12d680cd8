"""A hub id not yet in the hub cache, downloaded once per artifact store.

N replicas launched at once with the same new model would each download the whole checkpoint. Here one
launcher takes the store's claim for (hub cache, repo, commit) and downloads; the others wait on that
claim, show its progress (`<store>/.downloads/<key>.json`, rewritten by the downloader every second) and
go on with the files once they are in. When the holder dies its claim runs out and the next launcher
takes over, resuming the chunks already written (remote/ranged.py). When the hub cache is a node's own
folder, a waiter on another node finds nothing after the holder is done and downloads its own copy.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import httpx
import xxhash

from mxlaunch.errors import CheckFailed
from mxlaunch.fileutil import read_json, write_json_atomic
from mxlaunch.remote import hub
from mxlaunch.remote.ranged import CHUNK, WORKERS, Target, check_room, download
from mxlaunch.store.core import Store

CLAIM_TTL_S = 60.0
DOWNLOADS = ".downloads"
Emit = Callable[..., None]


@dataclass(frozen=True)
class Fetched:
    """Where the files are, and who fetched them (this launcher, another one, or nobody: already there)."""

    path: Path
    commit: str
    by: str  # "here" | "other" | "cached"
    bytes: int  # fetched by this launcher
    seconds: float


def claim_key(cache: Path, repo: str, commit: str) -> str:
    """One claim per cache folder, repo and commit (a valid store id)."""
    return "hub-" + xxhash.xxh3_64_hexdigest(f"{cache.resolve()}\0{repo}\0{commit}".encode())


def ensure_model(repo: str, revision: Optional[str], store: Store, emit: Emit, *,
                 cache: Path, environ: Mapping[str, str] = os.environ,
                 workers: int = WORKERS, chunk: int = CHUNK, poll_s: float = 0.5,
                 on_bytes: Callable[[int, int], None] = lambda done, total: None) -> Fetched:
    """The model's snapshot folder in the hub cache (`cache`, the caller's: engines/environment.hub_cache_dir),
    downloading what is missing once per store."""
    cache = Path(cache)
    ep, tok = hub.endpoint(environ), hub.token(environ)
    t0 = time.monotonic()
    with httpx.Client(headers=hub.headers(tok), follow_redirects=True, timeout=httpx.Timeout(30.0, connect=10.0),
                      limits=httpx.Limits(max_connections=workers + 2, max_keepalive_connections=workers + 2)) as client:
        rev = hub.fetch_revision(client, ep, repo, revision)
        if not hub.missing(cache, rev):
            hub.write_ref(cache, rev)
            return Fetched(hub.snapshot_dir(cache, rev), rev.commit, "cached", 0, time.monotonic() - t0)
        key = claim_key(cache, repo, rev.commit)
        progress_file = store.root / DOWNLOADS / f"{key}.json"

        def done() -> bool:
            if hub.missing(cache, rev):
                return False
            hub.write_ref(cache, rev)
            return True

        by, got = once_per_store(
            store, key, done=done, emit=emit, poll_s=poll_s, on_bytes=on_bytes, total=rev.total_bytes,
            progress_file=progress_file, extra={"repo": repo, "commit": rev.commit},
            waiting=f"another launcher downloads {repo}@{rev.commit[:12]} into {cache}: waiting for it",
            fetch=lambda cancelled: _download(client, cache, rev, progress_file, emit, workers, chunk, on_bytes, cancelled))
        return Fetched(hub.snapshot_dir(cache, rev), rev.commit, by, got, time.monotonic() - t0)


def once_per_store(store: Store, key: str, *, done: Callable[[], bool], fetch: Callable[[Callable[[], bool]], int],
                   emit: Emit, waiting: str, extra: dict, progress_file: Path, total: int, poll_s: float = 0.5,
                   on_bytes: Callable[[int, int], None] = lambda done, total: None) -> tuple[str, int]:
    """`fetch(cancelled)` in the one launcher holding the store's claim `key`; every other launcher waits
    (showing the holder's progress file) until `done()`. A holder that dies loses its claim by its lease,
    and the next launcher takes over (the fetch resumes). Returns (by, bytes): "here" and what this launcher
    fetched, or "other" and 0."""
    waited = False
    last_note = 0.0
    while True:
        claim = store.coordinator.try_claim(key, ttl_s=CLAIM_TTL_S, extra=extra)
        if claim is not None:
            with claim:
                claim.keep_alive()
                if done():  # the previous holder finished just now
                    return "other", 0
                return "here", fetch(lambda: claim.lost)
        if not waited:
            holder = store.coordinator.holder(key)
            emit("download-wait", **extra, holder=f"{holder.host}:{holder.pid}" if holder else "?", message=waiting)
            waited = True
        state = _read_progress(progress_file)
        if state and time.monotonic() - last_note >= 5.0:
            last_note = time.monotonic()
            on_bytes(int(state.get("done", 0)), int(state.get("total", total)))
            emit("download-progress", **extra, done=state.get("done"), total=state.get("total"))
        if store.coordinator.holder(key) is None and done():
            return "other", 0
        time.sleep(poll_s)


def _download(client: httpx.Client, cache: Path, rev: hub.HubRevision, progress_file: Path, emit: Emit,
              workers: int, chunk: int, on_bytes: Callable[[int, int], None], cancelled: Callable[[], bool]) -> int:
    todo = hub.missing(cache, rev)
    total = sum(f.size for f in todo)
    blobs: dict[str, hub.HubFile] = {}
    for f in todo:
        blobs.setdefault(f.blob, f)  # two paths with the same content: one blob
    done = [0]
    lock = threading.Lock()
    t0 = time.monotonic()
    last = [0.0]

    def progress(n: int) -> None:
        with lock:
            done[0] += n
            now = time.monotonic()
            if now - last[0] >= 1.0:
                last[0] = now
                write_json_atomic(progress_file, {"repo": rev.repo, "commit": rev.commit, "done": done[0],
                                                  "total": total, "pid": os.getpid()}, parents=True)
                on_bytes(done[0], total)

    def check_for(f: hub.HubFile) -> Callable[[Path], Optional[str]]:
        def check(path: Path) -> Optional[str]:
            if path.stat().st_size != f.size:
                return f"{path.stat().st_size} bytes, the hub says {f.size}"
            digest = hub.file_digest(path, f)
            return None if f.check(digest) else f"{'sha256' if f.lfs else 'git blob id'} {digest}, the hub says {f.blob}"
        return check

    targets = [Target(rev.url(f), hub.blob_path(cache, rev.repo, f), f.size, check_for(f))
               for f in blobs.values() if not _blob_ok(cache, rev.repo, f)]
    check_room(targets, chunk)  # before a word of it: a disk without room is the one line
    emit("download", status="start", repo=rev.repo, commit=rev.commit, files=len(todo), bytes=total,
         endpoint=rev.endpoint, cache=str(cache),
         message=f"downloading {len(todo)} file(s) of {rev.repo}@{rev.commit[:12]} ({total / (1 << 30):.2f} GiB) "
                 f"with {workers} parallel ranged GETs; other launchers on this store wait for it")
    try:
        got = download(client, targets, chunk=chunk, workers=workers, progress=progress, cancelled=cancelled)
    finally:
        progress_file.unlink(missing_ok=True)
    for f in todo:
        hub.link_file(cache, rev, f)
    hub.write_ref(cache, rev)
    left = hub.missing(cache, rev)
    if left:
        raise CheckFailed(f"{len(left)} file(s) of {rev.repo} are still missing after the download ({left[0].path})",
                          "run the launch again")
    seconds = time.monotonic() - t0
    on_bytes(total, total)
    emit("download", status="done", repo=rev.repo, commit=rev.commit, bytes=got, seconds=round(seconds, 3),
         gib_per_s=round(got / max(seconds, 1e-9) / (1 << 30), 3))
    return got


def _blob_ok(cache: Path, repo: str, f: hub.HubFile) -> bool:
    try:
        return hub.blob_path(cache, repo, f).stat().st_size == f.size
    except OSError:
        return False


def _read_progress(path: Path) -> Optional[dict]:
    try:
        doc = read_json(path)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ModelRequest:
    """What a launch wants fetched, built by the launcher from the engine's command (launch/model_fetch.py): this
    layer is handed a model, never a command line to parse."""

    model: str  # a hub id, an s3:// URL, or a local folder
    revision: Optional[str] = None
    hub_id: bool = False  # a hub id not given as a local folder: one to download into `cache`
    cache: Optional[Path] = None  # the hub cache the engine reads
    engine_fetches: str = ""  # why the engine downloads the model itself ("": it does not, fetch it here)


def download_request(request: ModelRequest, store: Store, emit: Emit, environ: Mapping[str, str] = os.environ,
                     **kw: object) -> Optional[Fetched]:
    """Before the launch plans: the request's model, when it is a hub id not in the hub cache, downloaded once per
    store (then the plan finds it, and the first serve captures). None when there is nothing to do: a local
    folder, a hub id already cached, HF_HUB_OFFLINE, or a model the engine downloads itself (said, with why)."""
    if not request.hub_id or request.cache is None:
        return None
    if hub.offline(environ):
        emit("download", status="off", repo=request.model, message="HF_HUB_OFFLINE is set: the model is not downloaded")
        return None
    if request.engine_fetches:
        emit("download", status="off", repo=request.model, message=request.engine_fetches)
        return None
    return ensure_model(request.model, request.revision, store, emit, cache=request.cache, environ=environ,
                        **kw)  # type: ignore[arg-type]
