"""moto's S3 server (`python -m moto.server`) with its writes serialized, as a real S3 serializes them.

moto checks a conditional PUT's If-None-Match / If-Match and then writes, in a server that handles requests in
threads: two racing claims could both pass the check (CI, session 31: four racers for one lease, two winners, in
tests/unit/test_s3_store.py — a rare interleaving on a loaded box). S3 itself makes a conditional write atomic,
which is what mxlaunch's S3 claims rely on (coord/s3.py). Reads stay concurrent.

    python tests/helpers/moto_serialized.py -H 127.0.0.1 -p PORT      (moto.server's own arguments)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import moto.server as server

_WRITES = threading.Lock()


class SerializedWrites(server.DomainDispatcherApplication):  # type: ignore[misc,name-defined]
    """One write at a time, the whole response built under the lock; reads as moto serves them."""

    def __call__(self, environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE"):
            with _WRITES:
                return list(super().__call__(environ, start_response))
        return super().__call__(environ, start_response)


server.DomainDispatcherApplication = SerializedWrites  # main() builds its app from this module-level name

if __name__ == "__main__":
    server.main()
