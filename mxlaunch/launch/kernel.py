"""JIT kernel caches around one launch: the plan's part (key, hit or miss, variables) and the run's part
(restore before the engine starts, capture back once the server is ready and the folders are still).

Nothing here fails a launch: any problem is a miss (or no capture) with a one-line reason.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from mxlaunch import settings
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.registry import ENGINES, spec_engine
from mxlaunch.kernelcache.caches import (FolderState, cache_key, cache_vars, changed, folder_state, key_fields, local_dir,
                                         side_dirs, sync_tree)
from mxlaunch.kernelcache.seed import seed_from_defaults
from mxlaunch.kernelcache.archive import KernelCacheStore
from mxlaunch.kernelcache.compile_log import CompileTally

SETTLE_S = 3.0  # the folders must stay unchanged this long after ready before they are captured
SETTLE_MAX_S = 120.0  # give up waiting for them to settle after this long
POLL_S = 1.0


def plan_kernel_cache(spec: LaunchSpec, *, source_id: str, device_type: str, kc_store: KernelCacheStore,
                      enabled: bool = True) -> Dict[str, Any]:
    """The plan's "kernel_cache": status (hit | miss | off), reason, key, fields, folder, variables."""
    if not enabled:
        return {"status": "off", "reason": "--no-kernel-cache"}
    try:
        fields = key_fields(spec, source_id=source_id, device_type=device_type, argv=spec.argv)
        key = cache_key(fields)
        folder = local_dir(key)
        engine = spec_engine(spec)
        cv = cache_vars(engine.kernel_cache_vars, folder)
        meta, why = kc_store.lookup(key)
    except Exception as exc:  # noqa: BLE001 — the cache is an optimisation: never a failed launch
        return {"status": "off", "reason": f"kernel cache unavailable ({type(exc).__name__}: {exc})"}
    if not cv.env:
        return {"status": "off", "reason": f"every cache variable is set by you ({', '.join(cv.unmanaged)})", "key": key}
    reason = why or f"archive of {meta['files']} files, {meta['bytes']} bytes in {kc_store.root / key}"
    if cv.unmanaged:
        reason += f"; left to you: {', '.join(cv.unmanaged)} (set in your environment)"
    return {"status": "found" if meta else "miss", "reason": reason, "key": key, "dir": str(folder),
            "env": cv.env, "unmanaged": cv.unmanaged, "fields": fields}


def by_cache(paths: list) -> Dict[str, int]:
    """How many of `paths` (relative to the key's folder) each cache holds, by its top folder (triton, deep_gemm,
    flashinfer, ...): which library compiled in a run that should have found its kernels (a seeding gap shows here)."""
    counts: Dict[str, int] = {}
    for rel in paths:
        top = Path(rel).parts[0] if Path(rel).parts else ""
        counts[top] = counts.get(top, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


class KernelCacheRun:
    """Restore before the engine starts; capture in the background after ready; stop on exit."""

    def __init__(self, info: Optional[Dict[str, Any]], kc_store: Optional[KernelCacheStore], emit: Callable[..., None],
                 model: Optional[str] = None) -> None:
        self.info = info or {"status": "off", "reason": "not planned"}
        self.kc_store = kc_store
        self.emit = emit
        self.model = model
        self.status = self.info["status"]
        self.before: Dict[str, Any] = {}
        self._stop = threading.Event()  # give up (no capture)
        self._held = threading.Event()  # the engine is being stopped: capture nothing until it is gone
        self._now = threading.Event()  # the engine is gone: capture what it wrote, settled or not
        self._thread: Optional[threading.Thread] = None
        self.side_before: Dict[str, FolderState] = {}
        self.max_bytes = settings.kernel_cache_max_bytes()
        self.tally = CompileTally()  # the engine's lines: graphs compiled afresh against loaded from its cache
        self._quiet = False  # given up and said so (stop): the capture thread reports nothing more
        self._say_lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.status != "off" and self.kc_store is not None

    def restore(self) -> Dict[str, str]:
        """Restore the key's archive into the node-local folder; the variables for the engine's environment."""
        if not self.active:
            self.emit("kernel-cache", status="off", reason=self.info.get("reason", ""))
            return {}
        assert self.kc_store is not None
        key, folder, t0 = self.info["key"], Path(self.info["dir"]), time.monotonic()
        result = self.kc_store.restore(key, folder, self.max_bytes)
        self.status = result.status
        try:
            for path in self.info["env"].values():
                if Path(path).is_relative_to(folder):  # not what stays in place (caches.KEPT_IN_PLACE)
                    Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.status = "off"
            self.emit("kernel-cache", status="off", reason=f"cannot create {folder}: {exc.strerror or exc}")
            return {}
        for sub, outside in side_dirs().items():  # caches no variable moves (Inductor's precompiled headers)
            try:
                sync_tree(folder / sub, outside)
            except OSError:
                pass  # a miss for that cache only: the engine rebuilds it
            # What the side folder holds now (this key's files, plus whatever other torch builds and runs left
            # there, ~150 MB a header): only what this run writes is captured back.
            self.side_before[sub] = folder_state(outside)
        reason = f"restored {result.files} files into {folder}" if result.status == "hit" else result.reason
        seeded: Dict[str, Any] = {"refused": True} if result.refused else {}  # not restored: a foreign or changed archive
        if result.rebased:
            reason += f"; {result.rebased} ninja-built module(s) moved from the folder it was captured in"
            seeded["ninja_moved"] = result.rebased
        if result.status == "miss" and not folder_state(folder):  # this key never ran on this node
            try:
                fields = self.info.get("fields", {})
                engine = ENGINES.get(fields.get("engine") or "")
                files, nbytes, why, moved = seed_from_defaults(self.info["env"], folder, self.max_bytes,
                                                                redirect=getattr(engine, "kernel_cache_redirect", None),
                                                                flashinfer_version=fields.get("versions", {}).get("flashinfer"))
            except OSError as exc:
                files, nbytes, why, moved = 0, 0, f"not seeded ({exc.strerror or exc})", 0
            seeded.update(seeded_files=files, seeded_bytes=nbytes, **({"ninja_moved": moved} if moved else {}))
            reason += f"; {why}"
        self.before = folder_state(folder)
        self.emit("kernel-cache", status=result.status, reason=reason, key=key, dir=str(folder), files=result.files,
                  bytes=result.bytes, seconds=round(time.monotonic() - t0, 3), unmanaged=self.info.get("unmanaged", []),
                  **seeded)
        return dict(self.info["env"])

    def skip(self, reason: str) -> Dict[str, str]:
        """No engine starts in this run (a restored engine snapshot: its kernels were compiled, or loaded, before
        its image was taken): nothing to restore and nothing to capture — whatever the node-local folder holds is
        not this run's work, and judging it against an empty "before" would report all of it as new."""
        if self.active:
            self.status = "off"
            self.emit("kernel-cache", status="off", reason=reason, key=self.info.get("key"))
        return {}

    def judge_ready(self) -> None:
        """At ready: a restore after which the engine compiled anyway (its log says so) is `partial`."""
        if not self.active:
            return
        status, reason = self.tally.judge(self.status)
        if status != self.status:
            self.status = status
            self.emit("kernel-cache", status=status, reason=reason, key=self.info.get("key"), **self.tally.counts())

    def start_capture(self) -> None:
        """After ready: wait for the folders to settle, then capture what is new (a background thread)."""
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._capture, name="mx-kernel-cache", daemon=True)
            self._thread.start()

    def _settled(self, folder: Path) -> Optional[Dict[str, Any]]:
        """The folder's state once it has not changed for SETTLE_S (None: given up). Once the engine is gone
        (`finish`), whatever it wrote is final: captured at once."""
        state, still_since, deadline = folder_state(folder), time.monotonic(), time.monotonic() + SETTLE_MAX_S
        while not self._stop.wait(POLL_S):
            if self._now.is_set():
                return folder_state(folder)
            if self._held.is_set():  # a stop has begun: wait for the engine to be gone, then capture
                deadline = float("inf")
                continue
            now_state = folder_state(folder)
            if now_state != state:
                state, still_since = now_state, time.monotonic()
            elif time.monotonic() - still_since >= SETTLE_S:
                return state
            if time.monotonic() > deadline:
                return None
        return None

    def _capture(self) -> None:
        assert self.kc_store is not None
        folder = Path(self.info["dir"])
        try:
            state = self._settled(folder)
            if state is None:
                if not self._stop.is_set():
                    self._say(status=self.status, published=False,
                              reason=f"the cache folders kept changing for {SETTLE_MAX_S:.0f} s; not captured")
                return
            for sub, outside in side_dirs().items():
                written = changed(self.side_before.get(sub, {}), folder_state(outside))
                if written and sync_tree(outside, folder / sub, only=written, own=True):  # a shared /tmp: ours only
                    state = folder_state(folder)
            new = changed(self.before, state)
            if not new and (self.status in ("hit", "local", "partial") or not state):  # a miss with a warm local folder still publishes it
                self._say(status=self.status, published=False, new_files=0,
                          reason="nothing new compiled")
                return
            outcome = "partial" if self.status in ("hit", "local", "partial") else "miss"
            result = self.kc_store.capture(self.info["key"], self.info["fields"], folder, self.max_bytes,
                                           model=self.model, stop=self._stop.is_set)
            self._say(status=outcome, published=result.published, new_files=len(new), new_by_cache=by_cache(new),
                      new=new[:10], files=result.files, bytes=result.bytes, seconds=round(result.seconds, 3), reason=result.reason)
        except Exception as exc:  # noqa: BLE001 — a failed capture must not stop serving
            self._say(status=self.status, published=False,
                      reason=f"capture failed ({type(exc).__name__}: {exc})")

    def hold(self) -> None:
        """The engine is about to be stopped: a file it writes meanwhile may be half-written, so nothing
        is captured until `finish` says it is gone."""
        self._held.set()

    def finish(self, budget_s: float) -> None:
        """The engine is gone: capture what it compiled if that has not happened yet — a first run stopped
        soon after ready still publishes its kernels — within `budget_s` (then given up)."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._now.set()
        self._thread.join(max(0.0, budget_s))
        if self._thread.is_alive():
            self.stop(timeout=2.0)

    def stop(self, timeout: float = 30.0) -> None:
        """No capture from now on; one still running after `timeout` is reported given up and says nothing more
        (the launcher's `exit` event, which follows, is its last)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            with self._say_lock:
                if self._thread.is_alive() and not self._quiet:
                    self._quiet = True
                    self.emit("kernel-cache-capture", status=self.status, published=False,
                              reason="given up: the launcher stopped while the capture was still running")

    def _say(self, **fields: Any) -> None:
        """The capture thread's one `kernel-cache-capture` event, unless it was given up first (stop)."""
        with self._say_lock:
            if not self._quiet:
                self.emit("kernel-cache-capture", **fields)
