"""The launcher's stage: this node's ranks copied into /dev/shm beside the engine's start, watched, freed, given up.

A mixin of launch/run.py's Launcher, whose state it reads and sets (the run folder, the plan, `stage_job`,
`stage_result`, `stage_error`, `loaded`). Why a module of its own: it is the one byte-moving job the supervisor
runs in the background (a shared-filesystem StageJob tuned to the Lustre layout, or an S3 store's ranged GETs),
and its failure has one answer — the abort marker that sends the engine's plugin to its default loader — while
the engine goes on starting. The supervisor only starts it and frees a rank's files when its marker says so.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from mxlaunch.contract import ABORT, staged_line
from mxlaunch.errors import MxlaunchError
from mxlaunch.fileutil import write_json_atomic
from mxlaunch.launch.decide import LaunchOptions, LaunchPlan, _rank_rel
from mxlaunch.safety.ownership import own_dir
from mxlaunch.slurm import default_readers
from mxlaunch.store.opener import open_store


class Staging:
    """Starting, watching, freeing and giving up the stage (mixed into launch/run.py's Launcher)."""

    plan: LaunchPlan
    opts: LaunchOptions
    store: Any  # store/core.py Store, opened on first use
    shm_dir: Path
    stage_job: Any  # staging/reader.py StageJob or the S3 store's, once started
    stage_result: Any
    stage_error: Optional[str]
    kept_bytes: int  # --keep-staged: linked from what the last launch kept (staging/kept.py)
    loaded: set[int]  # workers whose loaded (or fallback) marker was seen
    emit: Callable[..., None]
    echo: Callable[[str], None]
    _feed_profile: Callable[..., None]

    def _start_stage(self) -> None:
        if self.plan.strategy != "staged":
            return
        from mxlaunch.stage import default_per_file
        from mxlaunch.staging.reader import StageJob
        from mxlaunch.staging.sources import CopyItem

        items = []
        for f in self.plan.stage_files:
            rank, inner = _rank_rel(f.path)
            items.append(CopyItem(src=Path(f.path), rel=f"{rank}/{inner}", size=f.bytes))
        expected = self.plan.stage_expected()
        reserve = self.plan.stage_bytes if self.plan.device_type == "cpu" else 0  # CPU engines hold the weights in RAM too
        if self.opts.keep_staged:  # what the last launch of this source id on this node kept (staging/kept.py)
            items = self._reuse_kept(items, expected)
        self._make_room(sum(i.size for i in items) + reserve)  # kept snapshots give way to any launch's stage
        if not items:
            return
        store = self.store or open_store(self.opts.artifact_path)
        if getattr(store, "remote", False):  # an S3 store: parallel ranged GETs into /dev/shm (staging/s3_stage.py)
            job = store.stage_job(items, self.shm_dir / "stage", expected=expected, reserve_bytes=reserve).start()
            self.stage_job = job
            self._watch_stage(job)
            return
        readers = self.opts.readers or default_readers()
        from mxlaunch.staging.lustre import layouts_of
        from mxlaunch.staging.schedule import readers_for_layouts

        layouts = layouts_of([i.src for i in items])  # a store on Lustre: the schedule keeps every OST busy
        if not self.opts.readers_given:
            readers = readers_for_layouts(readers, layouts)  # and enough readers to keep each OST deep
        job = StageJob(items, self.shm_dir / "stage", readers=readers, expected=expected,
                       per_file=default_per_file(readers), reserve_bytes=reserve, layouts=layouts)
        job.start()
        self.stage_job = job
        self._watch_stage(job)

    def _stage_bytes_to_read(self) -> int:
        """What this launch's stage will still write into /dev/shm: its files less what the last launch kept
        (`--keep-staged`: linked, already there)."""
        if self.plan.strategy != "staged":
            return 0
        if not self.opts.keep_staged:
            return self.plan.stage_bytes
        from mxlaunch.staging import kept

        return max(0, self.plan.stage_bytes - kept.available(self.shm_dir.parent, self.plan.source_id,
                                                               self.plan.stage_expected()))

    def _reuse_kept(self, items: list, expected: dict) -> list:
        """Link the kept files into the stage folder; the items still to read. With none left the stage is
        over at once (the `staged` event says so)."""
        from mxlaunch.staging import kept

        reused = kept.reuse(self.shm_dir.parent, self.plan.source_id, expected, self.shm_dir / "stage")
        self.kept_bytes = reused.bytes
        left = [i for i in items if i.rel not in set(reused.rels)]
        if not left:
            self.emit("staged", bytes=0, seconds=0.0, gib_per_s=0.0, o_direct=True, kept_bytes=reused.bytes,
                      message="every file was kept in /dev/shm by the last launch of this snapshot: nothing read")
            line = staged_line(reused.bytes, 0.0)
            self.echo(line)
            self._feed_profile(line)
            return []
        return left

    def _make_room(self, nbytes: int) -> None:
        """Snapshots kept by earlier launches (`--keep-staged`, staging/kept.py) are dropped, least recently used
        first, when this launch's stage (and what a CPU engine holds besides) would not fit beside them."""
        from mxlaunch.staging import kept
        from mxlaunch.staging.capacity import capacity_of

        if not kept.entries(self.shm_dir.parent):
            return
        need = nbytes - capacity_of(self.shm_dir).usable
        dropped = kept.evict(self.shm_dir.parent, need, keep_id=self.plan.source_id) if need > 0 else []
        if dropped:
            self.emit("kept", status="evicted", source_ids=dropped,
                      message=f"dropped {len(dropped)} kept snapshot(s) from /dev/shm to make room for this stage")

    def _keep_rank(self, snapshot_rank: int) -> None:
        """`--keep-staged`: a rank's staged files (each checked as it landed) stay for the next launch."""
        from mxlaunch.staging import kept

        expected = self.plan.stage_expected(prefix=f"{snapshot_rank}/")
        try:
            total = kept.keep(self.shm_dir.parent, self.plan.source_id, self.shm_dir / "stage", expected)
        except (MxlaunchError, OSError) as exc:
            self.emit("kept", status="failed", reason=getattr(exc, "message", None) or str(exc))
            return
        self.emit("kept", status="kept", rank=snapshot_rank, bytes=total,
                  message="the staged files stay in /dev/shm for the next launch of this snapshot on this node "
                          "(mxlaunch kept --drop frees them)")

    def _watch_stage(self, job: Any) -> None:
        """Report the stage's end; a failure sends the engine to its default loader (the abort marker)."""

        def watch() -> None:
            try:
                result = job.wait()
                self.stage_result = result
                self.emit("staged", bytes=result.bytes, seconds=round(result.seconds, 3),
                          gib_per_s=round(result.gib_per_s, 3), o_direct=result.o_direct,
                          **({"kept_bytes": self.kept_bytes} if self.kept_bytes else {}))
                line = staged_line(result.bytes, result.seconds)
                self.echo(line)
                self._feed_profile(line)
            except Exception as exc:  # noqa: BLE001 — reported to the plugin through the abort marker
                self._abort_stage(getattr(exc, "message", str(exc)))

        threading.Thread(target=watch, name="mx-stage-watch", daemon=True).start()

    def _start_stage_or_fall_back(self) -> None:
        """Start staging; if it cannot start (no room after all, a clash), the engine is already running:
        it gets the abort marker and loads by its default loader, as when staging fails later."""
        try:
            self._start_stage()
        except (MxlaunchError, OSError) as exc:
            self._abort_stage(getattr(exc, "message", None) or str(exc))

    def _abort_stage(self, reason: str) -> None:
        """Staging failed: the abort marker sends the engine's plugin to its default loader; say why."""
        self.stage_error = reason
        write_json_atomic(own_dir(self.shm_dir / "markers") / ABORT, {"reason": reason}, private=True)
        self.emit("fallback", reason=f"staging failed: {reason}")

    def _free_stage(self, rank: int) -> None:
        """Remove a snapshot rank's staged files once every local worker that reads them has loaded."""
        snapshot_rank = next((w["snapshot_rank"] for w in self.plan.local_ranks if w["rank"] == rank), rank)
        sharing = {w["rank"] for w in self.plan.local_ranks if w["snapshot_rank"] == snapshot_rank}
        if sharing <= self.loaded:
            if self.opts.keep_staged and self.stage_error is None and self.plan.strategy == "staged":
                self._keep_rank(snapshot_rank)
            shutil.rmtree(self.shm_dir / "stage" / str(snapshot_rank), ignore_errors=True)
