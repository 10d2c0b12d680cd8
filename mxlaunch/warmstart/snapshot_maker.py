"""The thread that takes a launch's engine snapshot beside the serving engine and publishes it by rename.

Why a module of its own: when to take it (once the capture is published: `ready_to_take`), into which folder
(checked again as this user's alone), with sums for an image that goes into the store, and the one
`engine-snapshot` event the launch reports are the launch's side of taking one (warmstart/snapshot_take.py).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from mxlaunch.safety.ownership import ForeignPath
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpointError
from mxlaunch.warmstart.engine_snapshot import SnapshotError, cuda_or_none, find, own_root, snapshots_root
from mxlaunch.warmstart.snapshot_take import take


class SnapshotMaker(threading.Thread):
    """Takes the snapshot beside the serving engine once `ready_to_take()` says so (the capture published),
    publishes it by rename, and reports one `engine-snapshot` event (published, or failed with the reason)."""

    def __init__(self, binary: str, root_pid: int, key: str, marks: Path, emit: Callable[..., None],
                 ready_to_take: Callable[[], Optional[bool]], environ: Mapping[str, str] = os.environ,
                 sleep: bool = False, facts: Optional[Mapping[str, Any]] = None,
                 lean: Optional[Callable[[], str]] = None, sums: bool = False) -> None:
        super().__init__(name="mx-engine-snapshot", daemon=True)
        self.binary, self.root_pid, self.key, self.marks, self.sleep = binary, root_pid, key, marks, sleep
        self.lean, self.sums = lean, sums  # sums: the image goes into the store, checked at every restore
        self.emit, self.ready_to_take, self.facts, self.environ = emit, ready_to_take, facts, environ
        self.root = snapshots_root(environ)
        self.stopping = threading.Event()
        self._lock, self._quiet, self._said = threading.Lock(), False, False

    def _say(self, **fields: Any) -> None:
        """The one `engine-snapshot` event, unless the launcher gave up waiting (it reported `abandoned`)."""
        with self._lock:
            if not self._quiet:
                self._said = True
                self.emit("engine-snapshot", key=self.key, **fields)

    def silence(self) -> bool:
        """The launcher stops without waiting longer: no event from here on; True when none was said yet."""
        with self._lock:
            self._quiet = True
            return not self._said

    def run(self) -> None:
        try:
            while True:  # True: take it now; False: never (the capture failed); None: not yet
                decided = self.ready_to_take()
                if decided is not None or self.stopping.is_set():
                    break
                time.sleep(0.2)
            if not decided or self.stopping.is_set():
                return
            result = self._make()
            self._say(status="published", **result)
        except (SnapshotError, CriuError, CudaCheckpointError, OSError) as exc:
            self._say(status="failed", reason=str(exc))
        except ForeignPath as exc:
            self._say(status="failed", reason=exc.one_line())

    def _make(self) -> dict:
        self.root = own_root(self.environ)  # checked again: this user's alone, nobody else can swap it
        if find(self.root, self.key) is not None:
            raise SnapshotError("a snapshot of this command exists already")
        tmp = self.root / f".{self.key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            result = take(self.binary, self.root_pid, tmp, self.marks, cuda_or_none(), sleep=self.sleep,
                          facts=self.facts, lean=self.lean)
            if self.sums:
                from mxlaunch.warmstart.image_sums import write_sums  # noqa: PLC0415

                t0 = time.monotonic()
                write_sums(tmp)
                result["sums_s"] = round(time.monotonic() - t0, 3)
            final = self.root / self.key
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        kept = ("slept", "lean", "sleep_skipped", "sleep_s", "checkpoint_s", "dump_s", "gpu_restore_s", "wake_s",
                "pause_s", "bytes", "working_set_files", "working_set_s")
        return {k: result[k] for k in kept} | {"path": str(final), "gpu_pids": len(result["gpu_pids"]),
                                               "sums_s": result.get("sums_s")}
