"""The launcher around an engine it did not start (a restored engine snapshot) and around its exit (issue 42):
what it reports must be this run's, and nothing after its `exit` event. The engine here is a stand-in process;
the snapshot's own mechanics are tests/unit/test_engine_snapshot.py's."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.launch.run import Launcher
from mxlaunch.store.core import Store


def checkpoint(folder: Path) -> Path:
    """config.json + one real safetensors file: what make_plan reads."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    return folder


class Restored(subprocess.Popen):
    """Stands in for engine_snapshot.RestoredEngine: Popen-like, with the meta a restore reads."""

    meta: dict = {}


def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Launcher, list[tuple[str, dict]]]:
    from mxlaunch.launch import cleanup

    monkeypatch.setattr(cleanup, "SHM_ROOT", tmp_path / "shm")
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "kc"))
    store = Store(tmp_path / "store")
    plan = make_plan([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      str(checkpoint(tmp_path / "model"))], LaunchOptions(artifact_path=store.root), store)
    events: list[tuple[str, dict]] = []
    opts = LaunchOptions(artifact_path=store.root, run_dir=tmp_path / "logs", ready_timeout=60)
    return Launcher(plan, opts, emit=lambda e, **f: events.append((e, f)), echo=lambda line: None, store=store), events


def restore_as(runner: Launcher, monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """The launcher's snapshot restore hands back a process running `code`."""
    def restored(*_: Any, **__: Any) -> Restored:
        return Restored([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True)

    monkeypatch.setattr(runner.snapshots, "try_restore", restored)
    monkeypatch.setattr(runner.snapshots, "refill", lambda *a, **k: True, raising=False)


def test_a_restored_engine_gets_no_kernel_cache_restore_or_capture(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runner, events = launcher(tmp_path, monkeypatch)
    assert runner.kernel.active  # planned: a miss on this fresh node
    restore_as(runner, monkeypatch, "pass")
    assert runner.run() == 0
    [cache] = [f for e, f in events if e == "kernel-cache"]
    assert cache["status"] == "off" and "restored from its snapshot" in cache["reason"], events
    assert not runner.kernel.active and not [e for e, _ in events if e == "kernel-cache-capture"]
