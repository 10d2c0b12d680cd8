"""The plugin's marker files in the run folder, read by the launcher: loaded, fallback, captured.

A mixin of launch/run.py's Launcher, whose state it reads (the run folder, the capture, `loaded`) and whose
`_free_stage` (launch/run_stage.py) it calls. Why a module of its own: the markers are the one channel from the
engine's plugin back to the launcher (no sockets, no shared state; mxlaunch/contract.py names them), and each
is read only from a file of this user's that nobody else can write (cleanup.read_own_json) before it frees
files, reports, or moves a capture on. The supervisor polls them once a tick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from mxlaunch.contract import RENDEZVOUS_FILE, parse_marker_name
from mxlaunch.launch.cleanup import read_own_json


class Markers:
    """What the engine's ranks said since the last tick (mixed into launch/run.py's Launcher)."""

    shm_dir: Path
    capture: Any  # launch/capture.py CaptureSession while capturing
    loaded: set[int]
    emit: Callable[..., None]
    _free_stage: Callable[[int], None]

    def _check_markers(self) -> None:
        markers = self.shm_dir / "markers"
        if self.capture is not None:
            self.capture.poll()  # the claim holder publishes once every node's part is in (or gives up)
        if not markers.is_dir():
            return
        for path in sorted(markers.glob("*.json")):
            parsed = parse_marker_name(path)
            if parsed is None:
                continue
            kind, rank = parsed
            if kind == "loaded" and rank not in self.loaded:
                self.loaded.add(rank)
                self._free_stage(rank)  # give /dev/shm back as soon as no worker needs the files
                self.emit("loaded", rank=rank, **self._read_marker(path))
            elif kind == "fallback" and rank not in self.loaded:
                self.loaded.add(rank)
                self._free_stage(rank)
                self.emit("fallback", rank=rank, reason=self._read_marker(path).get("reason", "?"))
                if self.capture is not None:  # a capturing rank that fell back: no snapshot, free the claim now
                    self.capture.on_fallback(rank)
            elif kind == "captured" and self.capture is not None:
                self.capture.on_captured(rank, self._read_marker(path))

    def _read_marker(self, path: Path) -> dict:
        """A marker's fields to report (the rendezvous file it may name is the cleanup's business)."""
        data = _read_marker(path)
        data.pop(RENDEZVOUS_FILE, None)
        return data


def clear_markers(markers: Path, kind: str) -> list[str]:
    """Remove this run's `kind` markers (a restored engine's refill that failed: the engine started after it
    must not have its ranks' staged files freed for a load it never did); the names removed."""
    gone = []
    for path in sorted(markers.glob("*.json")) if markers.is_dir() else ():
        parsed = parse_marker_name(path)
        if parsed is not None and parsed[0] == kind:
            path.unlink(missing_ok=True)
            gone.append(path.name)
    return gone


def _read_marker(path: Path) -> dict:
    """A marker's fields, read only from a file of this user's that nobody else can write (read_own_json)."""
    data = read_own_json(path)
    return {k: v for k, v in data.items() if k != "rank"} if isinstance(data, dict) else {}
