"""One node's part of a capture: the claim (taken, or joined by the nodes of one job), the publish, and giving up
cleanly. Which workers write which snapshot rank is launch/capture_part.py; the upload of a capture written
through /dev/shm is launch/capture_upload.py (a mixin of CaptureSession).

**The claim.** One claim per source id, with the capture id in its `extra`. Every node of the job
tries it: one wins (the holder), the others see a holder with their own capture id and join; a holder
with another id is another job, and this node serves with the default loader — it then also says so in
the store (a `failed` node marker), so its job's holder gives up at once instead of waiting.

**The publish.** Each node moves its finished ranks into `data-<capture_id>/` and writes its node
marker; only the holder publishes, once every node's marker is in — so publishing and giving up are
one process's decisions and never race. The holder gives up when a node reports a failure, when its
claim is lost, or when a node has not reported `timeout_s` after the holder's own part was done
(MXLAUNCH_CAPTURE_TIMEOUT); it then removes the whole pending capture and releases the claim: nothing
published, and the next launch captures again. A holder killed outright leaves its lease to expire;
the next holder removes what is left (`Store.reap_captures`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from mxlaunch import settings
from mxlaunch.contract import SNAPSHOT_VERSION
from mxlaunch.errors import MxlaunchError
from mxlaunch.launch.capture_part import capture_part, snapshot_nranks
from mxlaunch.launch.capture_upload import CaptureUpload
from mxlaunch.staging.upload import UploadJob
from mxlaunch.store.core import SnapshotMeta, Store
from mxlaunch.store.capture import new_capture_id

if TYPE_CHECKING:
    from mxlaunch.launch.decide import LaunchPlan

CLAIM_TTL_S = 60.0
POLL_S = 1.0


def capture_timeout_s() -> float:
    return settings.capture_timeout()


class CaptureSession(CaptureUpload):
    """This node's part of one capture, driven by the launcher: `start` before the engine, `on_captured`
    / `on_fallback` from the plugin's markers, `engine_ready` once it serves, `poll` every supervision
    tick, `stop_upload` and `close` on exit.

    `local_root` (a folder in the run folder in /dev/shm): the plugin writes there and this session
    uploads into the store; None: the plugin writes into the store's temp folder. `copy` copies one
    file for the upload (default: staging/upload.py's `copy_file`, looked up when the upload starts; a
    test passes or patches in a failing or slow one)."""

    def __init__(self, store: Store, plan: "LaunchPlan", emit: Callable[..., None],
                 timeout_s: Optional[float] = None, local_root: Optional[Path] = None,
                 copy: Optional[Callable[..., tuple[int, str]]] = None, upload_at_once: bool = False,
                 keep_root: Optional[Path] = None) -> None:
        self.store = store
        self.plan = plan
        self.sid = plan.source_id
        self.emit = emit
        self.timeout_s = capture_timeout_s() if timeout_s is None else timeout_s
        self.part = capture_part(plan.local_ranks, snapshot_nranks(plan))
        self.capture_id: Optional[str] = plan.capture_id
        self.holder = False
        self.claim = None
        self.writer = None
        self.captured: set[int] = set()
        self.state = "idle"  # → capturing → (uploading →) waiting (node done) → published | failed
        self.done_at: Optional[float] = None
        self._next_poll = 0.0
        self.local_root = local_root
        self.copy = copy
        self.upload: Optional[UploadJob] = None
        self.ready = False  # the engine serves: a single-node capture uploads only then
        self.upload_at_once = upload_at_once  # --capture-only: the run exists for the snapshot, not for serving
        self._next_progress = 0.0
        self.keep_root = keep_root  # --keep-staged: the user root whose kept/ gets the uploaded /dev/shm copy
        self.kept = False

    # ---- state ----

    @property
    def published(self) -> bool:
        return self.state == "published"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    @property
    def multinode(self) -> bool:
        return self.part.nnodes > 1

    @property
    def via_shm(self) -> bool:
        return self.local_root is not None

    def plan_fields(self) -> tuple[str, dict[str, int]]:
        """The plan file's capture_dir and capture_ranks (worker rank → the snapshot rank it writes)."""
        assert self.writer is not None
        capture_dir = self.local_root if self.local_root is not None else self.writer.capture_dir
        return str(capture_dir), {str(w): r for w, r in sorted(self.part.workers.items())}

    # ---- start ----

    def start(self) -> Optional[str]:
        """Claim or join the capture and open this node's writer. None when capturing; else why not
        (the launcher then serves with the default loader)."""
        if not self.part.workers:
            return self.part.why_not
        cid, coord = self.capture_id, self.store.coordinator
        extra = {"capture_id": cid, "nnodes": self.part.nnodes} if cid else {}
        claim = coord.try_claim(self.sid, ttl_s=CLAIM_TTL_S, extra=extra)
        if claim is None:
            holder = coord.holder(self.sid)
            if not (cid and holder is not None and holder.extra.get("capture_id") == cid):
                who = f" ({holder.describe()})" if holder is not None else ""
                self._decline(f"another replica holds the capture claim{who}")
                return f"another replica claimed the capture first{who}; serving with the default loader"
            joined = holder.describe()
        else:
            self.claim, self.holder, joined = claim, True, ""
            claim.keep_alive()
            cid = cid or new_capture_id()
            reaped = self.store.reap_captures(self.sid, keep=cid)
            if reaped:
                self.emit("cleanup", message=f"removed the unpublished capture(s) {', '.join(reaped)} of {self.sid} "
                                             "(their claims had ended)")
        spec = self.plan.spec
        meta = SnapshotMeta(engine=spec.engine, engine_version=spec.engine_version, spec=spec.to_json(),
                            identity=self.plan.identity, snapshot_format=self.plan.snapshot_format,
                            snapshot_version=SNAPSHOT_VERSION)
        try:
            self.writer = self.store.begin_capture(self.sid, meta, nranks=self.part.nranks, nnodes=self.part.nnodes,
                                                   node_rank=self.part.node_rank, ranks=self.part.ranks, capture_id=cid)
        except MxlaunchError as exc:
            self._release()
            self._decline(f"cannot capture: {exc.one_line()}")
            return f"cannot capture: {exc.one_line()}"
        self.capture_id, self.state = cid, "capturing"
        if self.local_root is not None:
            for rank in self.part.ranks:  # the plugin writes <local_root>/<rank>/ as it would the store's folder
                (self.local_root / str(rank)).mkdir(parents=True, exist_ok=True)
        if self.multinode:
            role = "publishes it once every node's part is in" if self.holder else f"joins the claim of {joined}"
            self.emit("capture", capture_id=cid, message=f"node {self.part.node_rank} of {self.part.nnodes} writes "
                                                          f"snapshot rank(s) {self.part.ranks} of {self.sid}; {role}")
        return None

    def _decline(self, reason: str) -> None:
        """Tell this job's other nodes that this one will not deliver its part (their holder stops waiting)."""
        if self.capture_id and self.multinode:
            try:
                self.store.mark_node_failed(self.sid, self.capture_id, self.part.node_rank, reason)
            except (MxlaunchError, OSError):
                pass

    # ---- markers ----

    def on_captured(self, worker: int, marker: Optional[dict] = None) -> None:
        """A worker's `captured` marker; the event carries its timing and whether the parts were prepared."""
        if self.state != "capturing" or worker not in self.part.workers or worker in self.captured:
            return
        self.captured.add(worker)
        m = marker or {}
        self.emit("captured", rank=worker, **{k: m[k] for k in ("bytes", "seconds", "prepared") if k in m})
        if self.captured >= set(self.part.workers):
            if self.local_root is None:
                self._node_done()
            else:
                self.state = "uploading"
                self._start_upload()

    def engine_ready(self) -> None:
        """The engine serves: a capture through /dev/shm may upload now."""
        self.ready = True
        self._start_upload()

    def on_fallback(self, worker: int) -> None:
        """A capturing worker fell back: no snapshot from this capture (others' fallbacks do not matter)."""
        if self.state == "capturing" and worker in self.part.workers:
            self._give_up(f"rank {worker} could not capture (see its fallback)", error=self.multinode)

    # ---- this node's part is in ----

    def _node_done(self, recorded: bool = False) -> None:
        assert self.writer is not None
        try:
            if not recorded:  # written straight into the store: checksum the files there
                for rank in self.writer.ranks:
                    self.writer.add_rank_dir(rank)
            if not self.holder and not self._holder_is_ours():
                self._give_up("its claim holder gave up before this node's part was in")
                return
            won = self.writer.mark_node_done(publish=self.holder)
        except Exception as exc:  # noqa: BLE001 — a failed publish must not stop serving
            self._give_up(f"could not publish the snapshot: {getattr(exc, 'message', exc)}")
            return
        if won or (self.holder and self.store.lookup(self.sid).snapshot is not None):
            self._published()
            return
        self.state, self.done_at = "waiting", time.monotonic()
        waits = f"waits up to {self.timeout_s:.0f} s for" if self.holder else "the claim holder publishes once it has"
        self.emit("node-done", source_id=self.sid, capture_id=self.capture_id,
                  message=f"node {self.part.node_rank} of {self.part.nnodes} wrote its part; {waits} the other nodes' parts")

    # ---- waiting for the other nodes ----

    def poll(self, now: Optional[float] = None) -> None:
        """Holder: publish once every part is in, or give up. Other nodes: notice the outcome."""
        now = time.monotonic() if now is None else now
        if self.state == "uploading":
            return self._poll_upload(now)
        if self.state != "waiting" or now < self._next_poll:
            return
        self._next_poll = now + POLL_S
        try:
            self._poll_holder(now) if self.holder else self._poll_member()
        except Exception as exc:  # noqa: BLE001 — the store went away for a moment: the next tick retries
            self.emit("warning", message=f"capture {self.capture_id}: cannot read the store ({exc})")

    def _poll_holder(self, now: float) -> None:
        assert self.writer is not None and self.claim is not None
        if self.claim.lost:
            return self._give_up("the capture claim was lost (its lease ran out)")
        pending = self.store.pending(self.sid, self.capture_id or "")
        if pending.failed:
            node, why = sorted(pending.failed.items())[0]
            return self._give_up(f"node {node} will not deliver its part ({why})")
        if self.writer.publish() or self.store.lookup(self.sid).snapshot is not None:
            return self._published()
        if self.done_at is not None and now - self.done_at > self.timeout_s:
            missing = sorted(set(range(self.part.nnodes)) - pending.done)
            self._give_up(f"node(s) {', '.join(map(str, missing))} of {self.part.nnodes} never reported their part "
                          f"within {self.timeout_s:.0f} s (MXLAUNCH_CAPTURE_TIMEOUT) — see those nodes' logs")

    def _poll_member(self) -> None:
        ours = self._holder_is_ours()  # first the claim, then the manifest: the holder publishes before it releases
        if self.store.lookup(self.sid).snapshot is not None:
            self._published()
        elif not ours:
            self.state = "failed"
            self.emit("error", message=f"capture {self.capture_id} of {self.sid} published nothing: its claim holder "
                                       "gave up or died — see the other nodes' logs; the next launch captures again")

    def _holder_is_ours(self) -> bool:
        holder = self.store.coordinator.holder(self.sid)
        return holder is not None and holder.extra.get("capture_id") == self.capture_id

    # ---- outcomes ----

    def _published(self) -> None:
        self.state = "published"
        self.emit("published", source_id=self.sid, store=str(self.store.root))
        self._release()

    def _give_up(self, why: str, error: bool = True, fix: str = "") -> None:
        """No snapshot from this capture: the holder removes every node's part, a member only its own."""
        if self.state in ("published", "failed"):
            return
        was = self.state
        self.state = "failed"
        self.stop_upload()
        self._drop_local()
        self._drop_kept()  # no snapshot to restore: what was kept of it would only hold RAM
        if self.holder:
            self.store.discard_capture(self.sid, self.capture_id or "")
        else:
            if self.writer is not None:
                self.writer.abort()
            if was in ("capturing", "uploading") and self._holder_is_ours():
                self._decline(why)
        self._release()
        if error:
            self.emit("error", message=f"capture {self.capture_id} of {self.sid} published nothing: {why}; its parts "
                                       f"are removed and the next launch captures again{' — ' + fix if fix else ''}")

    def _release(self) -> None:
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    def close(self) -> None:
        """On exit (engine stopped): an unfinished capture is given up — the holder's leaves nothing behind."""
        if self.state == "uploading":
            self._give_up("this node stopped before its upload from /dev/shm into the store was done")
        elif self.state == "capturing" or (self.state == "waiting" and self.holder):
            self._give_up("this node stopped before every node's part was in")
        self.stop_upload()
        self._drop_local()
        if self.writer is not None:
            self.writer.abort()  # this node's temp folder, should a late writer have made it again
        self._release()
