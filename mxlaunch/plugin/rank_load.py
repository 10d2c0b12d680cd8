"""One worker's weight loading per the plan, for any engine: capture, staged restore, or the default.

The engine adapters (plugin/vllm.py, plugin/sglang.py) only find the model, the rank and the engine's
own "load the checkpoint's weights" step; what happens around it is the same everywhere and lives
here: the capture of raw tensors after the engine's weight loading and before its post-processing,
the staged restore with its per-file wait and fill checks, the fallback rules (only before the first
tensor lands, only when the plan allows it) and the markers the launcher watches (written through
plugin/rank_markers.py).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from mxlaunch.contract import gib, loaded_line
from mxlaunch.plugin.rank_markers import abort_reason, aborted, fall_back_or_stop, report_fallback, safe_marker


@dataclasses.dataclass
class Outcome:
    """What the weight step did; the adapter writes the loaded marker from it after post-processing."""

    strategy: str  # p2p | staged | capture | default
    bytes: int
    seconds: float
    plan: Any = None
    extra: dict = dataclasses.field(default_factory=dict)


def model_bytes(model: Any) -> int:
    from mxlaunch.plugin.loader import group_tensors, module_tensors

    return sum(g.tensor.numel() * g.tensor.element_size() for g in group_tensors(module_tensors(model)))


def distributed_rank() -> int | None:
    """torch.distributed's rank when a process group is up (both engines start one), else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001
        pass
    return None


def prepare_gpu(plan: Any, rank: int, log: logging.Logger) -> None:
    """A staged restore onto a GPU: while the engine builds the model, pin the copy ring and register
    this rank's staged files with the driver as they land (plugin/gpu_restore.py)."""
    if plan is None or getattr(plan, "strategy", None) != "staged":
        return
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            from mxlaunch.plugin.gpu_restore import prepare

            files = [str(f.path) for f in plan.files_for_rank(rank)]
            prepare(torch.cuda.current_device(), files, timeout_s=plan.wait_timeout_s,
                    cancelled=lambda: aborted(plan))
    except Exception as exc:  # noqa: BLE001 - the restore pins on demand instead
        log.warning("mxlaunch: could not start pinning host memory early: %s", exc)


class RankLoad:
    """The plan's weight path for one rank. `default_load()` runs the engine's own weight loading
    (without post-processing); `engine` names it in log lines ("vLLM", "SGLang")."""

    def __init__(self, model: Any, plan: Any, rank: int, default_load: Callable[[], None], *, engine: str,
                 log: logging.Logger, layout: Callable[[], dict] = dict,
                 prepare_layout: Callable[[], list[str]] = list,
                 capture_problem: Callable[[], str | None] = lambda: None) -> None:
        self.model = model
        self.plan = plan
        self.rank = rank
        self.default_load = default_load
        self.engine = engine
        self.log = log
        self.layout = layout
        # Online quantization (plugin/vllm_online_quant.py): the layers the engine quantizes while loading are
        # brought to that layout on placeholders before a restore lands over them; a capture is refused when
        # the loaded model keeps state outside its tensors.
        self.prepare_layout = prepare_layout
        self.capture_problem = capture_problem

    def run(self) -> Outcome:
        """Dispatch on the plan's strategy (no plan: the engine's default, as the adapter decided)."""
        plan = self.plan
        if plan is not None and plan.strategy == "p2p":
            outcome = self.p2p()
        elif plan is not None and plan.strategy == "capture":  # other DP replicas' workers only load: one copy per rank
            outcome = self.capture() if plan.capture_target(self.rank) is not None else self.default()
        elif plan is not None and plan.strategy == "staged":
            outcome = self.staged()
        else:
            outcome = self.default()
        self.raw_copy = None
        if self._serves("raw") and not outcome.extra.get("pending"):
            self.raw_copy = self._keep_raw()
        return outcome

    # -- p2p (plugin/p2p.py pulls, plugin/p2p_source.py serves): pull before post-processing (raw) or after it (processed) --

    def _serves(self, layout: str) -> bool:
        p2p = getattr(self.plan, "p2p", None)
        return bool(p2p and p2p.get("serve") and p2p.get("layout") == layout)

    def _keep_raw(self) -> Any:
        from mxlaunch.plugin import p2p_source
        from mxlaunch.plugin.loader import module_tensors

        try:
            started = time.perf_counter()
            copy = p2p_source.keep_raw(module_tensors(self.model))
            self.log.info("mxlaunch: rank %d keeps a %s GiB host copy of its raw tensors to serve them over P2P "
                          "(%.2f s; --no-p2p skips this)", self.rank, gib(copy.bytes), time.perf_counter() - started)
            return copy
        except Exception as exc:  # noqa: BLE001 - serving is a bonus, never a reason to stop
            self.log.warning("mxlaunch: rank %d will not serve P2P: %s", self.rank, exc)
            return None

    def p2p(self) -> Outcome:
        if self.plan.p2p["layout"] == "processed":  # after the engine's post-processing: finish_p2p()
            return Outcome("p2p", 0, 0.0, self.plan, {"pending": True})
        from mxlaunch.plugin.loader import module_tensors
        from mxlaunch.plugin.tensors import RestoreError

        prepared = self._layout_for_restore("P2P pull")
        try:
            result = self._pull(module_tensors(self.model))
        except RestoreError as exc:
            if exc.landed or prepared:
                from mxlaunch.plugin.tensors import Reinitialise

                raise Reinitialise(f"P2P pull failed after {'bytes landed' if exc.landed else _placeholders(prepared)}: "
                                   f"{exc}") from exc
            if not self.plan.fallback_ok:
                raise RuntimeError(f"mxlaunch: rank {self.rank}: {exc} and the plan forbids falling back") from exc
            return self.fall_back(f"P2P pull failed before any byte landed: {exc}")
        return result

    def finish_p2p(self, outcome: Outcome) -> None:
        """Processed layout, after post-processing on placeholder values: pull every tensor the model
        now holds. Any failure means rebuilding (post-processing cannot run twice)."""
        if not outcome.extra.pop("pending", False):
            return
        from mxlaunch.plugin.tensors import Reinitialise, RestoreError
        from mxlaunch.transfer.tensor_set import processed_tensors

        try:
            done = self._pull(processed_tensors(self.model))
        except RestoreError as exc:
            raise Reinitialise(f"P2P pull of the processed tensors failed: {exc}") from exc
        outcome.bytes, outcome.seconds, outcome.extra = done.bytes, done.seconds, done.extra

    def _pull(self, named: list) -> Outcome:
        from mxlaunch.coord.peers import open_registry
        from mxlaunch.plugin import p2p
        from mxlaunch.plugin.tensors import RestoreError

        p = self.plan.p2p
        try:
            registry = open_registry(p["registry"], None)
        except Exception as exc:  # noqa: BLE001
            raise RestoreError(f"cannot open the P2P registry {p['registry']}: {exc}", landed=False) from exc
        from mxlaunch.plugin.p2p_prepare import join_p2p_prepare

        prepared = join_p2p_prepare()
        r = p2p.pull(named, registry=registry, source_id=self.plan.source_id, rank=self.rank % p["world"], world=p["world"],
                     layout=p["layout"], timeout_s=p["timeout_s"])
        self.log.info("%s", loaded_line(self.rank, r.bytes, r.seconds, strategy="p2p"))
        self.log.info("mxlaunch: rank %d pulled %d tensors from %s on %s over %s: %.3f s transfer, %d registration(s) "
                      "in %.3f s%s", self.rank, r.tensors, r.source, r.host, r.transport, r.transfer_seconds, r.registrations,
                      r.register_seconds, f"; passed over: {'; '.join(r.skipped)}" if r.skipped else "")
        return Outcome("p2p", r.bytes, r.seconds, self.plan,
                       {"source": r.source, "source_host": r.host, "transport": r.transport, "transfer_seconds": round(r.transfer_seconds, 4),
                        "register_seconds": round(r.register_seconds, 4), "registrations": r.registrations,
                        "tensors": r.tensors, "phases": r.phases, "prepared": prepared,
                        **({"passed_over": r.skipped} if r.skipped else {})})

    def serve(self) -> None:
        """After the loaded marker: publish this worker as a P2P source (never raises)."""
        p = getattr(self.plan, "p2p", None)
        if not p or not p.get("serve"):
            return
        try:
            from mxlaunch.coord.peers import open_registry
            from mxlaunch.plugin import p2p_source
            from mxlaunch.plugin.p2p_prepare import join_p2p_prepare
            from mxlaunch.transfer.tensor_set import processed_tensors

            join_p2p_prepare()  # the agent started while the model was built

            if p["layout"] == "raw":
                if self.raw_copy is None:
                    return
                what: Any = self.raw_copy
            else:
                what = processed_tensors(self.model)
            pub = p2p_source.serve(what, registry=open_registry(p["registry"], None), source_id=self.plan.source_id,
                            rank=self.rank % p["world"], world=p["world"], layout=p["layout"], run_id=p["run_id"])
            extra = pub.record.extra
            host = extra.get("cuda_ipc_host_tensors")
            ipc = (f"CUDA IPC handles for {extra[p2p_source.HANDOFF]['allocations']} allocation(s), to this uid's peers "
                   "over a socket" + (
                       f", {host['count']} host-memory tensor(s) over NIXL ({', '.join(host['names'])})" if host else "")
                   if extra.get(p2p_source.HANDOFF) else
                   f"no CUDA IPC handles ({extra['cuda_ipc_why']})" if extra.get("cuda_ipc_why") else "NIXL only")
            self.log.info("mxlaunch: rank %d serves %s GiB (%s layout) over P2P as %s: %d region(s) registered in "
                          "%.3f s, checksums in %.3f s; %s", self.rank, gib(extra.get("bytes", 0)), p["layout"],
                          pub.record.worker, extra.get("regions", 0), extra.get("register_seconds", 0.0),
                          extra.get("digest_seconds", 0.0), ipc)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("mxlaunch: rank %d could not become a P2P source: %s", self.rank, exc)

    def default(self) -> Outcome:
        started = time.perf_counter()
        self.default_load()
        return Outcome("default", model_bytes(self.model), time.perf_counter() - started, self.plan)

    def fall_back(self, reason: str) -> Outcome:
        report_fallback(self.plan, self.rank, reason, self.log, self.engine)
        return self.default()

    def capture(self) -> Outcome:
        from mxlaunch.plugin.loader import CaptureError, capture_tensors, module_tensors

        plan, rank, log = self.plan, self.rank, self.log
        if not plan.capture_dir:
            outcome = self.default()
            outcome.strategy = "capture"
            report_fallback(plan, rank, "capture: the plan names no capture_dir; serving without capturing", log)
            return outcome
        out_dir = Path(plan.capture_dir) / str(plan.capture_target(rank))  # the snapshot rank this worker writes
        metadata = {"mxlaunch.rank": out_dir.name, "mxlaunch.source_id": plan.source_id}
        prepared = self._prepare_capture(out_dir, metadata)  # the parts laid out while the engine loads
        try:
            outcome = self.default()
            outcome.strategy = "capture"
            problem = self.capture_problem()
            if problem is not None:
                raise CaptureError(f"this model cannot be snapshotted: {problem}")
            result = capture_tensors(module_tensors(self.model), out_dir, metadata=metadata, prepared=prepared)
        except CaptureError as exc:
            report_fallback(plan, rank, f"capture failed, serving without a snapshot: {exc}", log)
            return outcome
        finally:
            if prepared is not None:
                prepared.discard()  # a no-op once its parts are in place; removes them on any failure
        files = [{"name": p.name, "path": str(p), "bytes": p.stat().st_size} for p in result.files]
        how = " straight into parts laid out during loading" if result.prepared else ""
        log.info("mxlaunch: rank %d captured %s GiB (%d tensors, %d files) into %s in %.2f s%s (added to this first "
                 "start; %s's weight loading took %.2f s)", rank, gib(result.bytes), result.tensors, len(files),
                 out_dir, result.seconds, how, self.engine, outcome.seconds)
        safe_marker(plan, "captured", rank, {"files": files, "bytes": result.bytes, "tensors": result.tensors,
                                             "seconds": round(result.seconds, 4), "load_seconds": round(outcome.seconds, 4),
                                             **({"prepared": result.prepared} if result.prepared else {}),
                                             **self.layout()}, log)
        return outcome

    def _prepare_capture(self, out_dir: Path, metadata: dict[str, str]) -> Any:
        """Start laying the capture's parts out (capture_prepare); None when it does not apply or fails."""
        from mxlaunch.plugin.capture_prepare import PreparedCapture
        from mxlaunch.plugin.loader import module_tensors

        try:
            return PreparedCapture.start(module_tensors(self.model), out_dir, metadata=metadata)
        except Exception as exc:  # noqa: BLE001 - the capture writes its parts after loading instead
            self.log.warning("mxlaunch: rank %d: cannot prepare the capture's files during loading: %s", self.rank, exc)
            return None

    def _layout_for_restore(self, what: str) -> list[str]:
        """The adapter's prepare_layout (online-quantized layers processed on placeholders); past this point the
        engine's default loader cannot run on this model, so any failure means a rebuild."""
        started = time.perf_counter()
        try:
            done = self.prepare_layout()
            if done:
                self.placeholders = {"layers": len(done), "seconds": round(time.perf_counter() - started, 4)}
                self.log.info("mxlaunch: rank %d brought %d online-quantized layer(s) to their loaded layout on "
                              "placeholders in %.3f s", self.rank, len(done), self.placeholders["seconds"])
            return done
        except Exception as exc:  # noqa: BLE001
            from mxlaunch.plugin.tensors import Reinitialise

            raise Reinitialise(f"{what}: bringing the online-quantized layers to their loaded layout failed: {exc}") from exc

    def staged(self) -> Outcome:
        from mxlaunch.plugin.loader import RestoreError, module_tensors, restore_tensors

        plan, rank = self.plan, self.rank
        files = plan.files_for_rank(rank)
        if not files:
            fall_back_or_stop(plan, rank, f"the plan lists no files for rank {rank}", self.log, self.engine)
            return self.default()
        prepared = self._layout_for_restore("staged restore")
        try:
            result = restore_tensors(module_tensors(self.model), [(f.path, f.bytes) for f in files],
                                     wait_timeout_s=plan.wait_timeout_s, cancelled=lambda: aborted(plan))
        except RestoreError as exc:
            if aborted(plan):
                exc = RestoreError(f"the launcher aborted staging: {abort_reason(plan)}", landed=exc.landed)
            if not exc.landed and prepared and plan.fallback_ok:  # the default loader cannot load this model now
                from mxlaunch.plugin.tensors import Reinitialise

                raise Reinitialise(f"staged restore failed after {_placeholders(prepared)}: {exc}") from exc
            if not exc.landed and plan.fallback_ok:
                return self.fall_back(f"staged restore failed before any tensor landed: {exc}")
            where = "after tensors landed" if exc.landed else "and the plan forbids falling back"
            raise RuntimeError(f"mxlaunch: rank {rank}: staged restore failed {where}: {exc} — stopping "
                               "rather than serving partial weights") from exc
        self.log.info("%s", loaded_line(rank, result.bytes, result.seconds))
        if result.gpu:
            g = result.gpu
            self.log.info("mxlaunch: rank %d GPU copy (%s): %s GiB from registered staged files, %s GiB through "
                          "%d pinned ring readers; waited %.2f s for pinned memory", rank, g.get("mode"),
                          gib(g.get("registered_bytes", 0)), gib(g.get("ring_bytes", 0)), g.get("readers", 0),
                          g.get("pin_wait_seconds", 0.0))
        return Outcome("staged", result.bytes, result.seconds, plan,
                       {"wait_seconds": round(result.wait_seconds, 4), "files": result.files,
                        "copy_bytes": result.copy_bytes, "tensors": result.tensors,
                        **({"placeholders": self.placeholders} if getattr(self, "placeholders", None) else {}),
                        **({"gpu": result.gpu} if result.gpu else {})})

    def write_loaded(self, outcome: Outcome) -> None:
        """After the engine's post-processing: the launcher frees this rank's staged files on this marker."""
        if "mxlaunch.plugin.gpu_restore" in sys.modules:  # staged files still page-locked: unpin first
            outcome.extra["unpin_wait_seconds"] = round(sys.modules["mxlaunch.plugin.gpu_restore"].release_pending(), 4)
        if "mxlaunch.plugin.capture_prepare" in sys.modules:  # captured parts still page-locked
            outcome.extra["capture_unpin_wait_seconds"] = round(
                sys.modules["mxlaunch.plugin.capture_prepare"].release_pending(), 4)
        if outcome.plan is None:
            return
        safe_marker(outcome.plan, "loaded", self.rank,
                    {"bytes": outcome.bytes, "seconds": round(outcome.seconds, 4), "strategy": outcome.strategy,
                     **outcome.extra, **self.layout()}, self.log)


def _placeholders(prepared: list[str]) -> str:
    return f"{len(prepared)} online-quantized layer(s) were processed on placeholders ({prepared[0]}, …)"
