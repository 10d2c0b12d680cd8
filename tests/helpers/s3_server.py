"""A real S3-compatible server for the tests: moto's server mode (`python -m moto.server`) in a process of its
own on a free port, and the environment that points boto3 at it (AWS_ENDPOINT_URL, test credentials).

Its request log (werkzeug's, on its stderr) is kept in a file, so a test can count the GETs an object got at
the server ("exactly one download").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from tests.helpers.vllm_server import free_port


SERIALIZED = Path(__file__).with_name("moto_serialized.py")  # moto's server, writes one at a time


class S3Server:
    """`with S3Server(tmp) as s3:` — `s3.env` for the launcher, `s3.client()` to make buckets and objects."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "moto.log"
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_SHARED_CREDENTIALS_FILE": str(folder / "no-credentials"),
                    "AWS_CONFIG_FILE": str(folder / "no-config")}
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "S3Server":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._log_fh = open(self.log, "wb")
        self._proc = subprocess.Popen([sys.executable, str(SERIALIZED), "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=self._log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto's server exited {self._proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                httpx.get(self.url + "/moto-api/", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("moto's server did not answer in 60 s")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log_fh.close()

    def client(self):  # noqa: ANN201 — a boto3 client
        import boto3  # noqa: PLC0415

        return boto3.session.Session().client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                                              aws_secret_access_key="testing", region_name="us-east-1")

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> None:
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")

    def gets(self, key: str) -> int:
        """GET requests the server logged for one object (a ranged GET each)."""
        text = self.log.read_text(errors="replace")
        return len(re.findall(rf'GET /[^/ ]+/{re.escape(key)}\?', text))  # 206 lines come with colour codes


def s3_environ(server: S3Server, **extra: str) -> dict[str, str]:
    """os.environ without the caller's own AWS settings, pointed at the test server."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**base, **server.env, **extra}
