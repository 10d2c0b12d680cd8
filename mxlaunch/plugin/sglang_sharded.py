"""SGLang's stock dump formats as snapshots: SGLang writes them, SGLang's own loaders read them back.

`--snapshot-format sharded_state` (SGLang's ShardedStateLoader):

capture  SGLang's default load (weights *and* post-processing), then `ShardedStateLoader.save_model`
         writes this rank's state dict as model-rank-<tp_rank>-part-<n>.safetensors into
         <capture_dir>/<rank>/; markers captured-<rank> and loaded-<rank>
staged   wait until every staged file of this rank has landed (a failure before that falls back to
         SGLang's default loader), then ShardedStateLoader.load_model reads them from the staged folder;
         marker loaded-<rank>

`--snapshot-format presharded` (SGLang 0.5.23's PreshardedModelLoader; one folder for all ranks, kept
as snapshot rank 0, single node):

capture  SGLang's "first-time load and dump" with presharded_path = <capture_dir>/0 (its files, checksum.json
         and READY); markers captured-<rank> and loaded-<rank>
staged   wait for every staged file, write READY (not kept in the store: only .safetensor(s)/.json files
         are), then PreshardedModelLoader with presharded_path = the staged folder — when SGLang finds the
         dump does not match this launch's shard config it loads from the checkpoint instead, and the
         rank reports a fallback

Both are riskier than raw, and guarded before launch (engines/sglang_engine.snapshot_format_refusal): the dump holds
post-processed weights, which some quantized and MLA models cannot reload. Unlike raw, the engine starts
reading only once all of a rank's files are staged (SGLang's loader globs the folder).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from mxlaunch.contract import gib, loaded_line
from mxlaunch.plugin.rank_load import model_bytes
from mxlaunch.plugin.rank_markers import fall_back_or_stop, report_fallback, safe_marker, wait_for_rank_files

log = logging.getLogger("sglang.mxlaunch")


def sharded_loader(load_config: Any, plan: Any, rank: int, *, original: Any) -> Any:
    """The loader for this rank (its key in the plan, computed once by plugin/sglang.py): capture around
    SGLang's default one, or its ShardedStateLoader on the staged files; `original` (SGLang's own choice)
    when the files never arrived and the plan allows it."""
    if plan.strategy == "capture":
        return _capture_class()(load_config, plan, rank)
    files = plan.files_for_rank(rank)
    reason = wait_for_rank_files(plan, files, rank, "sharded_state")
    if reason is None:
        return _restore_class()(load_config, plan, rank, Path(files[0].path).parent)
    fall_back_or_stop(plan, rank, reason, log, "SGLang")
    return original


def _capture_class() -> type:
    from sglang.srt.model_loader.loader import DefaultModelLoader, ShardedStateLoader

    class ShardedCaptureLoader(DefaultModelLoader):
        """SGLang's default load, then its own sharded_state dump of this rank."""

        def __init__(self, load_config: Any, plan: Any, rank: int) -> None:
            super().__init__(load_config)
            self._plan, self._rank = plan, rank

        def load_model(self, *, model_config: Any, device_config: Any) -> Any:
            started = time.perf_counter()
            model = super().load_model(model_config=model_config, device_config=device_config)
            load_seconds = time.perf_counter() - started
            plan, rank = self._plan, self._rank
            target = plan.capture_target(rank)
            if target is None:  # another DP replica's worker captures this snapshot rank: one copy per rank
                log.info("mxlaunch: rank %d serves without capturing: another DP replica writes its snapshot rank", rank)
                safe_marker(plan, "loaded", rank, {"bytes": model_bytes(model), "seconds": round(load_seconds, 4),
                                                   "strategy": "default"}, log)
                return model
            out = Path(plan.capture_dir or "") / str(target)
            try:
                if not plan.capture_dir:
                    raise RuntimeError("the plan names no capture_dir")
                out.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                ShardedStateLoader.save_model(model, str(out))
                paths = sorted(out.glob("*.safetensors"))
                files = [{"name": p.name, "path": str(p), "bytes": p.stat().st_size} for p in paths]
                size = sum(f["bytes"] for f in files)
                log.info("mxlaunch: rank %d captured %s GiB as SGLang sharded_state (%d files) into %s in %.2f s",
                         rank, gib(size), len(files), out, time.perf_counter() - t0)
                safe_marker(plan, "captured", rank, {"files": files, "bytes": size, "format": "sharded_state",
                                                     "load_seconds": round(load_seconds, 4)}, log)
            except Exception as exc:  # noqa: BLE001 — serving goes on without a snapshot
                report_fallback(plan, rank, f"sharded_state capture failed, serving without a snapshot: {exc}", log)
            safe_marker(plan, "loaded", rank, {"bytes": model_bytes(model), "seconds": round(load_seconds, 4),
                                               "strategy": "capture"}, log)
            return model

    return ShardedCaptureLoader


def _restore_class() -> type:
    import dataclasses

    from sglang.srt.configs.load_config import LoadFormat
    from sglang.srt.model_loader.loader import ShardedStateLoader

    class StagedShardedStateLoader(ShardedStateLoader):
        """SGLang's ShardedStateLoader, reading this rank's staged folder instead of the model folder."""

        def __init__(self, load_config: Any, plan: Any, rank: int, folder: Path) -> None:
            super().__init__(dataclasses.replace(load_config, load_format=LoadFormat.SHARDED_STATE,
                                                 model_loader_extra_config={}))
            self._plan, self._rank, self._folder = plan, rank, folder

        def download_model(self, model_config: Any) -> None:
            return None  # the weights are staged

        def _prepare_weights(self, model_name_or_path: str, revision: Any) -> str:
            return str(self._folder)

        def load_model(self, *, model_config: Any, device_config: Any) -> Any:
            started = time.perf_counter()
            model = super().load_model(model_config=model_config, device_config=device_config)
            seconds = time.perf_counter() - started
            size = sum(f.bytes for f in self._plan.files_for_rank(self._rank))
            log.info("%s", loaded_line(self._rank, size, seconds))
            safe_marker(self._plan, "loaded", self._rank, {"bytes": size, "seconds": round(seconds, 4),
                                                           "strategy": "staged", "format": "sharded_state"}, log)
            return model

    return StagedShardedStateLoader


def presharded_loader(load_config: Any, plan: Any, rank: int, *, original: Any) -> Any:
    """SGLang's PreshardedModelLoader on the capture folder (capture) or the staged folder (staged)."""
    if plan.strategy == "capture":
        if not plan.capture_dir or plan.capture_target(rank) is None:  # another DP replica writes the dump
            return original
        return _presharded_class()(load_config, plan, rank, Path(plan.capture_dir) / "0")
    files = plan.files_for_rank(rank)
    reason = wait_for_rank_files(plan, files, rank, "sharded_state")
    if reason is None:
        checksum = next((Path(f.path) for f in files if Path(f.path).name == "checksum.json"), None)
        if checksum is None:
            reason = "the staged presharded dump has no checksum.json"
        else:
            (checksum.parent / "READY").touch()  # SGLang's own "dump complete" flag; every file has landed
            return _presharded_class()(load_config, plan, rank, checksum.parent.parent)
    fall_back_or_stop(plan, rank, reason, log, "SGLang")
    return original


def _presharded_class() -> type:
    import dataclasses

    from sglang.srt.model_loader.loader import PreshardedModelLoader

    class MxlaunchPreshardedLoader(PreshardedModelLoader):
        """PreshardedModelLoader rooted at the plan's folder, reporting to the launcher."""

        def __init__(self, load_config: Any, plan: Any, rank: int, root: Path) -> None:
            extra = dict(load_config.model_loader_extra_config or {})
            extra["presharded_path"] = str(root)
            super().__init__(dataclasses.replace(load_config, model_loader_extra_config=extra))
            self._plan, self._rank = plan, rank

        def load_model(self, *, model_config: Any, device_config: Any) -> Any:
            plan, rank = self._plan, self._rank
            shard_config = self._collect_shard_config(model_config)
            folder = self._presharded_dir(model_config, shard_config)
            reuse = self._presharded_ready(folder) and self._shard_config_matches(folder, shard_config)
            if plan.strategy == "staged" and not reuse:
                report_fallback(plan, rank, f"the staged presharded dump does not match this launch's shard config "
                                            f"({folder}); SGLang loads from the checkpoint", log)
            started = time.perf_counter()
            model = super().load_model(model_config=model_config, device_config=device_config)
            seconds = time.perf_counter() - started
            if plan.strategy == "capture":
                # READY is SGLang's "dump complete" flag; the store keeps only data and JSON files (it is
                # written again on restore, once every staged file has landed)
                (Path(folder) / self.READY_FILENAME).unlink(missing_ok=True)
                files = [{"name": str(p.relative_to(folder)), "path": str(p), "bytes": p.stat().st_size}
                         for p in sorted(Path(folder).rglob("*")) if p.is_file()]
                size = sum(f["bytes"] for f in files)
                log.info("mxlaunch: rank %d captured %s GiB as SGLang presharded (%d files) into %s",
                         rank, gib(size), len(files), folder)
                safe_marker(plan, "captured", rank, {"files": files, "bytes": size, "format": "presharded"}, log)
                safe_marker(plan, "loaded", rank, {"bytes": model_bytes(model), "seconds": round(seconds, 4),
                                                   "strategy": "capture"}, log)
            elif reuse:
                size = sum(f.bytes for f in plan.files_for_rank(rank))
                log.info("%s", loaded_line(rank, size, seconds))
                safe_marker(plan, "loaded", rank, {"bytes": size, "seconds": round(seconds, 4),
                                                   "strategy": "staged", "format": "presharded"}, log)
            return model

    return MxlaunchPreshardedLoader
