"""`launch --engine-snapshot` inside one launch: restore the command's snapshot if there is one, else start
the engine dumpable and snapshot it once it serves (the mechanics are warmstart/engine_snapshot.py's and its siblings').

Kept out of run.py the way warmstart/zygote_starts.py keeps the zygote: the launcher asks four things — a
restored engine or None, the engine's extra environment, whether to start it dumpable, and to start the
maker once ready — and tells it when it stops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, Optional

from mxlaunch import settings
from mxlaunch.fileutil import mark_used
from mxlaunch.store.core import ENGINE_SNAPSHOTS
from mxlaunch.warmstart.engine_checkpoint import criu_version, run_quietly, socket_blocker
from mxlaunch.warmstart import criu
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpointError
from mxlaunch.warmstart import lean_snapshot
from mxlaunch.warmstart import working_set
from mxlaunch.warmstart.image_sums import SUMS, check_sums
from mxlaunch.warmstart.image_stage import ImageDamaged, NoRoom, remove_copy, stage_image, staging_root
from mxlaunch.warmstart.engine_snapshot import META, SnapshotError, cuda_or_none, find, own_root, snapshots_root
from mxlaunch.warmstart.snapshot_maker import SnapshotMaker
from mxlaunch.warmstart.snapshot_restore import RestoredEngine, restore
from mxlaunch.warmstart.snapshot_key import key_facts, key_of, key_salt
from mxlaunch.safety.ownership import ForeignPath


STORE_FOLDER = ENGINE_SNAPSHOTS  # below the store's root: <uid>/<key>/, as the node-local folder


class EngineSnapshots:
    def __init__(self, enabled: bool, argv: list[str], source_id: str, shm_dir: Path, log_dir: Path,
                 emit: Callable[..., None], p2p: bool = False, environ: Mapping[str, str] = os.environ,
                 store_root: Optional[Path] = None) -> None:
        self.emit, self.log_dir, self.environ = emit, log_dir, environ
        self.shm_dir = shm_dir  # the run folder: a store-held image is staged into it (warmstart/image_stage.py)
        # Where the snapshots live: a lean one (no weights, a few GB) in the artifact store, so that a new job or a
        # wiped node restores it (`store_root`: a local store's root); a full one (tens of GB) node-local.
        self.in_store = (settings.snapshot_sleep(environ) == 2 and store_root is not None
                         and not settings.engine_snapshots(environ))
        self.root_env: Mapping[str, str] = {**environ, settings.ENGINE_SNAPSHOTS: str(Path(store_root) / STORE_FOLDER)} \
            if self.in_store and store_root is not None else environ
        self.binary: Optional[str] = None
        self.key, self.facts = "", {}  # made once snapshots are on: the key's salt lives in the private folder
        self.marks = shm_dir / "snapshot-marks"
        self.maker: Optional[SnapshotMaker] = None
        self.restored: Optional[RestoredEngine] = None
        self.sleep = False  # the engine sleeps while it is snapshotted (engine_args decides)
        self.lean = False  # ... at level 2, its weights left out of the image (warmstart/lean_snapshot.py)
        self._ahead: Optional[tuple] = None  # stage_image_ahead's (folder, copy, staged, why) for try_restore
        self._read_ahead: Optional[working_set.ReadAhead] = None  # the restored processes' file pages (warmstart/working_set.py)
        if not enabled:
            return
        if p2p:  # a P2P pull or source holds NIXL agents and peers' handles: not a state to freeze and bring back
            emit("engine-snapshot", status="off", reason="P2P starts are not snapshotted")
            return
        self.binary, why = criu.why_not(environ)
        if self.binary is not None:  # the zygote's rules, and the engine's HTTP socket
            why = socket_blocker(criu_version(run_quietly([self.binary, "--version"])), os.uname().release) or ""
            self.binary = None if why else self.binary
        if self.binary is not None:
            try:  # the launcher's environment, as the engine inherits it (warmstart/snapshot_key.py: what is keyed)
                self.facts = key_facts(argv, source_id, environ, key_salt(own_root(self.root_env)), os.getcwd())
                self.key = key_of(self.facts)
            except ForeignPath as exc:
                self.binary, why = None, exc.one_line()
            except (OSError, ValueError) as exc:
                self.binary, why = None, f"the engine snapshots' folder: {exc}"
        if self.binary is None:
            emit("engine-snapshot", status="off", reason=why)

    @property
    def dumpable(self) -> bool:
        """Start the engine so that it can be snapshotted (no io_uring, the NVML handler installed)."""
        return self.binary is not None and self.restored is None

    def engine_args(self, sleep_flags: tuple[str, ...], argv: list[str], refill_extension: Optional[str] = None,
                    lean_blocker: Callable[[], str] = lambda: "") -> list[str]:
        """Flags to add to a dumpable start: with $MXLAUNCH_SNAPSHOT_SLEEP=1, on a CUDA node, the engine's
        `snapshot_sleep_flags` (vLLM: --enable-sleep-mode), so that it can sleep (its KV cache dropped) while it
        is snapshotted; none for an engine without them. With =lean (2) also its `refill_extension` (the worker
        method a lean snapshot's refill calls), unless `lean_blocker()` says why not (then it sleeps at level 1)."""
        level = settings.snapshot_sleep(self.environ)
        self.sleep = self.dumpable and bool(sleep_flags) and level > 0 and cuda_or_none() is not None
        if not self.sleep:
            return []
        extra: list[str] = []
        if level == 2:
            why = "" if refill_extension else "the engine cannot refill its weights"
            why = why or lean_blocker()
            if not why:
                extra, why = lean_snapshot.lean_flags(argv, refill_extension or "")
            self.lean = not why
            if why:
                self.emit("engine-snapshot", status="not-lean", reason=f"{why}: the snapshot sleeps at level 1 "
                                                                       "(its weights in the image)")
        return [f for f in sleep_flags if f not in argv] + extra

    def env(self) -> dict[str, str]:
        if not self.dumpable:
            return {}
        self.marks.mkdir(parents=True, exist_ok=True)
        return {settings.SNAPSHOT_DIR: str(self.marks)}

    def lean_ahead(self, strategy: str) -> bool:
        """Whether this launch will try a lean snapshot (its weights come from the stage): then the launcher
        starts staging before the restore, so the weights land while CRIU restores the processes."""
        if self.binary is None or strategy != "staged":
            return False
        folder = find(snapshots_root(self.root_env), self.key)
        try:
            return folder is not None and bool(json.loads((folder / META).read_text(encoding="utf-8")).get("lean"))
        except (OSError, ValueError):
            return False

    def try_restore(self, strategy: str = "staged") -> Optional[RestoredEngine]:
        """The command's snapshot, restored and unlocked; None when there is none or it cannot be restored
        (reported; the launcher then starts the engine as usual). A lean one (`restored.meta["lean"]`) is
        restored only when this launch stages its weights (`strategy`), and waits for `refill`."""
        if self.binary is None:
            return None
        ahead, self._ahead = self._ahead, None
        folder, copy, staged, why = ahead or self._image_for(strategy)
        if folder is None:
            return None
        if why:
            self.emit("engine-snapshot", status="skipped", key=self.key, reason=why)
            return None
        try:
            engine, info = restore(self.binary, copy or folder, self.log_dir / "snapshot-restore")
        except (SnapshotError, CriuError, CudaCheckpointError, OSError, ValueError, KeyError) as exc:
            self.emit("engine-snapshot", status="failed", key=self.key, reason=f"restore: {exc}")
            return None
        finally:
            remove_copy(copy)  # read by CRIU: its pages are the restored processes' memory now
        info.update(staged)
        if self._read_ahead is not None:  # how far it got by now (it goes on beside the engine if not done)
            info["read_ahead"] = self._read_ahead.result(timeout=0)
        self.restored = engine
        mark_used(folder)  # `store prune` removes the least recently used first (a lean one lives in the store)
        self.emit("engine-snapshot", status="restored", key=self.key, path=str(folder), **info)
        return engine

    def stage_image_ahead(self, strategy: str, reserve_bytes: int = 0) -> None:
        """Copy a store-held image into the run folder now, before the weights' stage starts: CRIU needs all of
        the image before the engine needs any weight, and from one disk the two read side by side took 5.7 s for
        the 2.7 GB image on the H200 (alone: ~1.8 s). try_restore restores this copy; drop_ahead removes it.
        `reserve_bytes`: the weights still to stage — an image that would leave them no room is restored in place
        (a stage that runs out of room would send the engine to its own loader)."""
        if self.binary is not None:
            self._ahead = self._image_for(strategy, reserve_bytes)

    def drop_ahead(self) -> None:
        """No restore after all (a stop signal, a stage that could not start): the staged image copy goes."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            remove_copy(ahead[1])

    def _image_for(self, strategy: str, reserve_bytes: int = 0) -> tuple[Optional[Path], Optional[Path], dict, Optional[str]]:
        """(the snapshot's folder or None, its staged copy or None, the stage's numbers, why not to restore)."""
        folder = find(snapshots_root(self.root_env), self.key)
        if folder is None:
            return None, None, {}, None
        copy, staged = None, {}
        try:
            meta = json.loads((folder / META).read_text(encoding="utf-8"))
            why = lean_snapshot.why_not_restore(meta, strategy)
            if why is None and self._read_ahead is None:  # the software's pages, while the image stages
                self._read_ahead = working_set.start(meta, self.environ)
            if why is None and (folder / SUMS).exists():  # a store-held image: staged and checked as it lands
                copy, staged, why = self._stage_image(folder, reserve_bytes)
        except (OSError, ValueError) as exc:
            why = f"its {META}: {exc}"
        return folder, copy, staged, why

    def _stage_image(self, folder: Path, reserve_bytes: int = 0) -> tuple[Optional[Path], dict, Optional[str]]:
        """The store's image copied into the run folder, checked as it lands (warmstart/image_stage.py): (the
        copy, its stage's numbers, None); without room there (None, {}, None) once its sums match in place;
        (None, {}, why) for an image that must not be restored."""
        root = staging_root(self.shm_dir)
        try:
            if root is not None:
                copy, staged = stage_image(folder, root, reserve_bytes=reserve_bytes)
                return copy, staged, None
        except ImageDamaged as exc:
            return None, {}, f"the image in {folder} is damaged: {exc}"
        except NoRoom as exc:
            self.emit("engine-snapshot", status="in-place", key=self.key,
                      reason=f"the image is restored from the store, not staged: {exc}")
        damaged = check_sums(folder)
        return None, {}, damaged and f"the image in {folder} is damaged: {damaged}"

    def refill(self, plan_file: Path) -> bool:
        """A restored lean engine: refill its weights from `plan_file` (the staged snapshot) and wake it. False
        when it could not (reported): the restored engine is stopped — it holds no usable weights."""
        if self.restored is None or not self.restored.meta.get("lean"):
            return True
        try:
            info = lean_snapshot.refill(self.restored, plan_file)
        except (SnapshotError, OSError, ValueError) as exc:
            self.emit("engine-snapshot", status="failed", key=self.key,
                      reason=f"refill: {exc}; the restored engine is stopped and the engine starts as usual")
            self.restored.kill_tree()
            self.restored = None
            return False
        self.emit("engine-snapshot", status="refilled", key=self.key, **info)
        return True

    def start_maker(self, root_pid: int, ready_to_take: Callable[[], Optional[bool]],
                    refill_plan: Optional[Callable[[], str]] = None) -> None:
        """Once the engine serves: snapshot it when ready_to_take() is True (never when it turns False). A lean
        snapshot's serving engine refills from the plan file `refill_plan()` writes (the store's files)."""
        if not self.dumpable or find(snapshots_root(self.root_env), self.key) is not None:
            return
        self.maker = SnapshotMaker(self.binary or "", root_pid, self.key, self.marks, self.emit, ready_to_take,
                                   self.root_env, sleep=self.sleep, facts=self.facts,
                                   lean=refill_plan if self.lean else None, sums=self.in_store)
        self.maker.start()

    def reap(self) -> None:
        """After the engine stopped: a restored tree's orphans are ours (the subreaper's) to reap."""
        if self.restored is not None:
            self.restored.reap_tree()

    def abandon(self, wait_s: float) -> None:
        """The launcher stops: a snapshot not begun is not taken; one under way may finish (the engine is
        paused until it does)."""
        if self.maker is not None and self.maker.is_alive():
            self.maker.stopping.set()
            self.maker.join(wait_s)
            if self.maker.is_alive() and self.maker.silence():  # its outcome would come after the launcher's exit
                self.emit("engine-snapshot", status="abandoned", key=self.key,
                          reason=f"still being taken {wait_s:g} s after the launcher began to stop; a half-made "
                                 "one is never published")
