"""A hub-compatible HTTP server for the tests (HF_ENDPOINT): the part of the Hugging Face Hub's API that
mxlaunch and huggingface_hub (inside vLLM) call, serving repos from local folders.

- `GET /api/models/{repo}/revision/{rev}[?blobs=true]`: the commit and the files (size, sha256 for
  *.safetensors as LFS files, the git blob id for the rest);
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: the listing huggingface_hub's list_repo_files reads;
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: the file, with byte ranges (206), ETag and X-Repo-Commit.

It counts what it served (bytes and GETs per file) so that a test can say "exactly one download", and
can drop a connection part-way through a file once (`drop_once`), serve a file that does not match
its listed hash (`corrupt`), or demand a token (`token`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    """A repo served from a folder: each file's size and hashes computed once; the bytes read from disk."""

    name: str
    folder: Path
    commit: str = ""
    files: dict[str, Path] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    blob_id: dict[str, str] = field(default_factory=dict)

    def load(self) -> "Repo":
        for p in sorted(self.folder.rglob("*")):
            if p.is_file():
                rel = p.relative_to(self.folder).as_posix()
                data = p.read_bytes()
                self.files[rel], self.sizes[rel] = p, len(data)
                self.sha256[rel], self.blob_id[rel] = hashlib.sha256(data).hexdigest(), git_blob_id(data)
        self.commit = hashlib.sha1("".join(k + self.sha256[k] for k in self.files).encode()).hexdigest()
        return self

    def lfs(self, path: str) -> bool:
        return path.endswith(".safetensors")

    def etag(self, path: str) -> str:
        return self.sha256[path] if self.lfs(path) else self.blob_id[path]

    def sibling(self, path: str, blobs: bool) -> dict:
        out: dict = {"rfilename": path}
        if blobs:
            out.update(size=self.sizes[path], blobId=self.blob_id[path])
            if self.lfs(path):
                out["lfs"] = {"sha256": self.sha256[path], "size": self.sizes[path], "pointerSize": 134}
        return out

    def read(self, path: str, start: int, end: int) -> bytes:
        with open(self.files[path], "rb") as fh:
            fh.seek(start)
            return fh.read(end - start + 1)


class HubServer:
    """Start with `with HubServer({"org/tiny": folder}) as hub:`; `hub.url` is the HF_ENDPOINT."""

    def __init__(self, repos: dict[str, Path], *, token: Optional[str] = None) -> None:
        self.repos = {name: Repo(name, Path(folder)).load() for name, folder in repos.items()}
        self.token = token
        self.bytes_served: Counter = Counter()
        self.gets: Counter = Counter()
        self.drop_once: dict[str, int] = {}  # path → drop the connection after this many bytes, once
        self.corrupt: set[str] = set()  # paths served with their last byte flipped (the listing keeps the true hash)
        self.requests: list[str] = []  # "METHOD path?query", in arrival order
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def weight_gets(self) -> int:
        """GETs of weight files (safetensors) served, over all repos."""
        return sum(n for p, n in self.gets.items() if p.endswith(".safetensors"))

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _error(self, status: int, code: str, text: str) -> None:
                body = json.dumps({"error": text}).encode()
                self.send_response(status)
                self.send_header("x-error-code", code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, doc: object) -> None:
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _repo(self, name: str, rev: str) -> Optional[Repo]:
                if hub.token and self.headers.get("authorization") != f"Bearer {hub.token}":
                    self._error(401, "RepoNotFound", "Repository Not Found")
                    return None
                repo = hub.repos.get(name)
                if repo is None:
                    self._error(404, "RepoNotFound", "Repository Not Found")
                    return None
                if rev not in ("main", repo.commit):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                    return None
                return repo

            def _serve(self, head: bool) -> None:
                with hub.lock:
                    hub.requests.append(f"{self.command} {self.path}")
                parts = urlsplit(self.path)
                path, query = unquote(parts.path), parts.query
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
                if m:
                    repo = self._repo(m.group(1), m.group(2))
                    if repo:
                        blobs = "blobs=true" in query
                        self._json({"id": repo.name, "modelId": repo.name, "sha": repo.commit, "private": False,
                                    "siblings": [repo.sibling(p, blobs) for p in repo.files]})
                    return
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
                if m:
                    repo = self._repo(m.group(1), m.group(2))
                    if repo:
                        under = (m.group(3) or "").strip("/")
                        entries = []
                        for p in repo.files:
                            if under and not p.startswith(under + "/"):
                                continue
                            entry = {"type": "file", "oid": repo.blob_id[p], "size": repo.sizes[p], "path": p}
                            if repo.lfs(p):
                                entry["lfs"] = {"oid": repo.sha256[p], "size": repo.sizes[p], "pointerSize": 134}
                            entries.append(entry)
                        self._json(entries)
                    return
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not m:
                    return self._error(404, "EntryNotFound", f"no route {path}")
                repo = self._repo(m.group(1), m.group(2))
                if not repo:
                    return
                rel = m.group(3)
                if rel not in repo.files:
                    return self._error(404, "EntryNotFound", f"{rel} not found")
                size = repo.sizes[rel]
                start, end, status = 0, size - 1, 200
                rng = self.headers.get("range")
                if rng:
                    r = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                    if not r:
                        return self._error(416, "RangeNotSatisfiable", rng)
                    start = int(r.group(1))
                    end = min(int(r.group(2)) if r.group(2) else size - 1, size - 1)
                    status = 206
                self.send_response(status)
                etag = repo.etag(rel)
                self.send_header("etag", f'"{etag}"')
                self.send_header("x-repo-commit", repo.commit)
                if repo.lfs(rel):
                    self.send_header("x-linked-etag", f'"{etag}"')
                    self.send_header("x-linked-size", str(size))
                self.send_header("accept-ranges", "bytes")
                if status == 206:
                    self.send_header("content-range", f"bytes {start}-{end}/{size}")
                self.send_header("content-length", str(end - start + 1))
                self.end_headers()
                if head:
                    return
                with hub.lock:
                    hub.gets[rel] += 1
                    drop = hub.drop_once.pop(rel, None)
                if rel in hub.corrupt or drop is not None:  # the faults: the bytes in hand, then changed
                    body = repo.read(rel, start, end)
                    if rel in hub.corrupt and end == size - 1:
                        body = body[:-1] + bytes([body[-1] ^ 0xFF])
                    if drop is not None and drop < len(body):
                        self.wfile.write(body[:drop])
                        with hub.lock:
                            hub.bytes_served[rel] += drop
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    self.wfile.write(body)
                else:  # sendfile: the kernel copies, no GIL held, as a real server would
                    self.wfile.flush()
                    with open(repo.files[rel], "rb") as fh:
                        pos = start
                        while pos <= end:
                            n = os.sendfile(self.connection.fileno(), fh.fileno(), pos, end - pos + 1)
                            if n == 0:
                                break
                            pos += n
                with hub.lock:
                    hub.bytes_served[rel] += end - start + 1

        return Handler
