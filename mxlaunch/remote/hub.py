"""A model hub's HTTP API (the Hugging Face Hub, or any server that speaks it at HF_ENDPOINT) and the hub
cache's on-disk layout, which the engines read.

The API used: `GET {endpoint}/api/models/{repo}/revision/{rev}?blobs=true` names the commit and every
file with its size and hash (sha256 for LFS files, the git blob id for the rest); `GET
{endpoint}/{repo}/resolve/{commit}/{path}` serves a file, with byte ranges. The cache layout is
huggingface_hub's, so that vLLM and SGLang, given the same hub id, find the files without a request:

    <cache>/models--<org>--<name>/
        blobs/<hash>                     each file once, named by its hash; written as <hash>.incomplete first
        snapshots/<commit>/<path>        relative symlinks to ../../blobs/<hash>
        refs/<revision>                  the commit a branch or tag pointed at (written last)
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional
from urllib.parse import quote

import httpx

from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.fileutil import unique_name
from mxlaunch.safety.ownership import create_own

DEFAULT_ENDPOINT = "https://huggingface.co"
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Weight formats the engines do not read when a checkpoint has safetensors (vLLM's and SGLang's default
# load format takes *.safetensors first): never downloaded next to them.
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.onnx", "*.gguf", "*.tflite", "*.ot")


@dataclass(frozen=True)
class HubFile:
    """One file of a repo at a commit: where it goes, how big, and the hash that names its blob."""

    path: str
    size: int
    blob: str  # sha256 (LFS) or git blob id: the blob's file name in the cache
    lfs: bool

    def check(self, digest: str) -> bool:
        return digest == self.blob


@dataclass(frozen=True)
class HubRevision:
    """A repo at one commit: the files an engine needs from it."""

    endpoint: str
    repo: str
    revision: str  # as asked (a branch, a tag or a commit)
    commit: str
    files: tuple[HubFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def url(self, f: HubFile) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{self.commit}/{quote(f.path)}"


def endpoint(environ: Mapping[str, str] = os.environ) -> str:
    return (environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """HF_TOKEN, else the token file huggingface_hub's login writes (HF_TOKEN_PATH, HF_HOME/token)."""
    if environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN"):
        return environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN")
    home = Path(environ.get("HF_HOME") or Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    path = Path(environ.get("HF_TOKEN_PATH") or home / "token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def offline(environ: Mapping[str, str] = os.environ) -> bool:
    return any(environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def headers(tok: Optional[str]) -> dict[str, str]:
    return {"user-agent": "mxlaunch", **({"authorization": f"Bearer {tok}"} if tok else {})}


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def wanted(paths: Iterable[str]) -> set[str]:
    """The files an engine reads: all of them, except other weight formats beside safetensors."""
    paths = set(paths)
    if not any(p.endswith(".safetensors") for p in paths):
        return paths
    return {p for p in paths if not any(fnmatch.fnmatch(os.path.basename(p), pat) for pat in OTHER_WEIGHTS)}


def fetch_revision(client: httpx.Client, ep: str, repo: str, revision: Optional[str]) -> HubRevision:
    """The commit a revision names and its files' sizes and hashes, from the hub's API (one request)."""
    rev = revision or "main"
    url = f"{ep}/api/models/{repo}/revision/{quote(rev, safe='')}"
    try:
        resp = client.get(url, params={"blobs": "true"})
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach the model hub at {ep} for {repo} ({type(exc).__name__}: {exc})",
                         "check the network or HF_ENDPOINT, or download the model where the hub is reachable "
                         "and set HF_HUB_OFFLINE=1") from None
    _raise_for_hub(resp, repo, rev, ep)
    try:
        doc = resp.json()
        commit = str(doc["sha"])
        files = []
        for s in doc.get("siblings") or []:
            lfs = s.get("lfs") or None
            blob = str(lfs["sha256"]) if lfs else str(s.get("blobId") or "")
            size = int(lfs["size"]) if lfs else int(s["size"])
            files.append(HubFile(path=str(s["rfilename"]), size=size, blob=blob, lfs=bool(lfs)))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"the model hub at {ep} answered {repo}@{rev} with no usable file list ({exc!r})",
                          "check HF_ENDPOINT: it must speak the Hugging Face Hub API") from None
    if not COMMIT.match(commit):
        raise CheckFailed(f"the model hub at {ep} named {commit!r} as the commit of {repo}@{rev}",
                          "check HF_ENDPOINT: it must speak the Hugging Face Hub API")
    for f in files:
        if not f.blob or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", f.blob) or _unsafe(f.path):
            raise CheckFailed(f"the model hub at {ep} listed {f.path!r} of {repo} without a usable hash or path",
                              "check HF_ENDPOINT: it must speak the Hugging Face Hub API")
    keep = wanted(f.path for f in files)
    return HubRevision(ep, repo, rev, commit, tuple(sorted((f for f in files if f.path in keep), key=lambda f: f.path)))


def _unsafe(path: str) -> bool:
    parts = path.split("/")
    return path.startswith("/") or any(p in ("", ".", "..") for p in parts)


def _raise_for_hub(resp: httpx.Response, repo: str, rev: str, ep: str) -> None:
    """The hub's refusals as one line each (its X-Error-Code says which; a 401 may hide a missing repo)."""
    if resp.status_code < 400:
        return
    code = resp.headers.get("x-error-code", "")
    if code == "RevisionNotFound":
        raise UsageError(f"revision {rev!r} of {repo} does not exist on {ep}",
                         "give a branch, tag or commit the repo has (--revision)")
    if code == "GatedRepo" or resp.status_code == 403:
        raise UsageError(f"the model hub at {ep} refused {repo} (HTTP {resp.status_code}: gated)",
                         "set HF_TOKEN to a token that may read it, and accept the model's licence on the hub")
    if resp.status_code == 401:
        raise UsageError(f"the model hub at {ep} refused {repo} (HTTP 401: private, or no such repo)",
                         "check the hub id (org/name), and set HF_TOKEN to a token that may read it")
    if resp.status_code == 404:
        raise UsageError(f"model {repo} does not exist on {ep}", "check the hub id (org/name), or give a local model folder")
    raise CheckFailed(f"the model hub at {ep} answered HTTP {resp.status_code} for {repo}@{rev}",
                      "try again later (the hub may be busy), or check HF_ENDPOINT")


# ---- the cache's layout ---------------------------------------------------------------------------------


def blob_path(cache: Path, repo: str, f: HubFile) -> Path:
    return repo_folder(cache, repo) / "blobs" / f.blob


def snapshot_dir(cache: Path, rev: HubRevision) -> Path:
    return repo_folder(cache, rev.repo) / "snapshots" / rev.commit


def missing(cache: Path, rev: HubRevision) -> list[HubFile]:
    """The files not yet in the cache at that commit (a blob of the right size behind its link)."""
    snap = snapshot_dir(cache, rev)
    out = []
    for f in rev.files:
        link, blob = snap / f.path, blob_path(cache, rev.repo, f)
        try:
            ok = blob.stat().st_size == f.size and link.resolve() == blob.resolve()
        except OSError:
            ok = False
        if not ok:
            out.append(f)
    return out


def link_file(cache: Path, rev: HubRevision, f: HubFile) -> None:
    """snapshots/<commit>/<path> → ../../blobs/<hash> (relative, like huggingface_hub), replaced atomically."""
    link = snapshot_dir(cache, rev) / f.path
    link.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob_path(cache, rev.repo, f), link.parent)
    tmp = _own_temp(link, "mx-link")
    os.symlink(target, tmp)
    _replace_or_drop(tmp, link)


def write_ref(cache: Path, rev: HubRevision) -> None:
    """refs/<revision> = commit, last: the cache names the revision only once every file is in."""
    if rev.revision == rev.commit:
        return
    ref = repo_folder(cache, rev.repo) / "refs" / rev.revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = _own_temp(ref, "mx-ref")
    with os.fdopen(create_own(tmp, mode=0o644), "w", encoding="utf-8") as fh:  # never through a planted link
        fh.write(rev.commit)
    _replace_or_drop(tmp, ref)


def _own_temp(path: Path, kind: str) -> Path:
    """A temp name beside `path` that no other process uses: launchers pulling one model at once each write the
    same ref and links, and a shared temp name let one's rename take the file from under another's."""
    return path.with_name(f"{unique_name(f'.{path.name}.')}.{kind}")


def _replace_or_drop(tmp: Path, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def git_blob_id(path: Path) -> str:
    """The git blob id of a file (sha1 of "blob <size>\\0" + content): the hub's hash for non-LFS files."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path, f: HubFile) -> str:
    if not f.lfs:
        return git_blob_id(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(4 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
