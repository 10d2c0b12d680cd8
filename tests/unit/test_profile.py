"""`profile`'s parser on real engine logs (tests/fixtures/logs) and on hand-written ones per version."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxlaunch.errors import UsageError
from mxlaunch.profile.profiler import (
    PHASES,
    StartupProfiler,
    compute_stats,
    merge_nodes,
    profile_file,
    profile_text,
    report,
)

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "logs"  # real logs, copied into the repository
OURS = Path(__file__).resolve().parent / "fixtures_logs"

SGLANG_TP4 = REAL / "sglang-0.5.x-apertus8b-tp4-gpu.log"
SGLANG_WORKER = REAL / "sglang-0.5.x-llama70b-tp8-2node-worker.log"
VLLM_011 = REAL / "vllm-0.11.0-gpu-qwen3-vl-30b-a3b-tp4.log"
SGLANG_H200_FIRST = REAL / "sglang-0.5.16-h200-flashinfer-first-start.log"
VLLM_CPU = REAL / "vllm-0.32-cpu-tiny-llama.log"
VLLM_026_FRESH = REAL / "vllm-0.26-h200-compile-fresh-node.log"


def phases(path: Path, engine: str = "auto") -> tuple:
    run = profile_file(path, engine)
    return run, {p.name: round(p.seconds, 3) for p in run.phases}


def test_sglang_tp4_real_log_takes_slowest_rank_figures() -> None:
    run, ph = phases(SGLANG_TP4)
    assert (run.engine, run.role, run.ready) == ("sglang", "server", True)
    assert ph["weight_loading"] == 101.66  # TP2's 101.66, not TP0's 101.61
    assert ph["dist_init"] == 5.64
    assert ph["cuda_graph_capture"] == 17.13
    assert ph["piecewise_cuda_graph_capture"] == 21.42
    # 08:04:59 (server_args) → 08:07:50 (ready line); the Slurm wrapper lines are not engine lines.
    assert run.total_seconds == 171.0
    assert ph["worker_spawn"] == 11.0  # server_args 08:04:59 → first "Init torch distributed begin" 08:05:10
    assert ph["warmup"] == 10.0  # Uvicorn running 08:07:40 → fired up 08:07:50
    assert ph["kv_cache_alloc"] == 0.0 and ph["http_startup"] == 0.0
    assert ph["unknown"] == pytest.approx(4.15, abs=1e-6)
    assert "torch_compile" not in ph  # SGLang compiles inside the piecewise capture: not counted twice


def test_sglang_worker_node_is_ready_once_its_scheduler_is_up() -> None:
    run, ph = phases(SGLANG_WORKER)
    assert (run.role, run.ready) == ("worker", True)
    assert run.total_seconds == 92.0  # 15:54:03 → "Dummy health check server started" 15:55:35
    assert ph["dist_init"] == 14.63  # TP5, the slowest
    assert ph["weight_loading"] == 3.23  # TP4
    assert ph["cuda_graph_capture"] == 21.03
    assert ph["piecewise_cuda_graph_capture"] == 39.87
    assert ph["kv_cache_alloc"] == 2.0  # TP7: load end 15:54:31 → memory pool end 15:54:33
    assert "http_startup" not in ph and "warmup" not in ph


def test_vllm_011_real_log() -> None:
    run, ph = phases(VLLM_011)
    assert (run.engine, run.role, run.ready) == ("vllm", "server", True)
    assert run.total_seconds == 116.0  # 15:56:22 → Application startup complete (after 15:58:18)
    # the weights: "Loading weights took 25.29 seconds" (TP3), not "Model loading took ... 25.534107 seconds",
    # which adds model construction and post-processing
    assert ph["weight_loading"] == 25.29
    # 0.11 logs no world_size line at INFO: gloo's first "[Gloo] Rank N is connected" (after the 15:56:44 line)
    # → "rank R in world size 4 is assigned" 15:56:46
    assert ph["dist_init"] == 2.0
    assert ph["torch_compile"] == 13.11  # "torch.compile takes 13.11 s in total", TP3
    assert ph["cuda_graph_capture"] == 19.0
    assert ph["kv_cache_alloc"] == pytest.approx(54.87 - 13.11 - 19.0)  # init engine minus compile and graphs
    assert ph["process_startup"] == 13.0  # → "Initializing a V1 LLM engine" 15:56:35
    assert ph["http_startup"] == 6.0  # init engine done 15:58:12 → startup complete 15:58:18
    assert ph["unknown"] == pytest.approx(116.0 - sum(v for k, v in ph.items() if k != "unknown"), abs=1e-3)


def test_a_silent_jit_build_is_named_by_the_gap_it_leaves() -> None:
    """vLLM 0.26 on a fresh H200 node, compile on: 96 s with no line after the graph capture (FlashInfer
    builds its sampler; vLLM announced the sampler 30 s earlier). The profile reports that gap and names it.
    The two interpreters' imports (API server, engine core) are silences too, named by no line; the compile,
    logged line by line, is none."""
    run, ph = phases(VLLM_026_FRESH)
    assert run.ready and ph["torch_compile"] == 22.41
    assert [(x.seconds, x.likely is None) for x in run.silences] == [(22.0, True), (23.0, True), (96.0, False)]
    gap = run.silences[2]
    assert gap.seconds == 96.0  # 05:26:36 → 05:28:12
    assert gap.after.startswith("Free memory on device") and "FlashInfer's JIT build of its sampler" in gap.likely
    assert run.to_dict()["silences"][2]["seconds"] == 96.0
    assert all(x.likely is None for x in profile_file(VLLM_011).silences)  # no such announcement there


def test_sglangs_warm_up_jit_build_is_named_through_the_health_polls_it_answers_503() -> None:
    """SGLang 0.5.16 on a fresh H200 node: HTTP is up at 22 s, then its warm-up request JIT-builds FlashInfer's
    attention kernels for 181 s while the client's /health polls are answered 503 (and logged). The polls do not
    end the silence; the gap is named by the attention backend the server args chose, and only the gap after HTTP
    came up (the scheduler's imports before it are not FlashInfer's build)."""
    run, ph = phases(SGLANG_H200_FIRST)
    assert (run.engine, run.ready) == ("sglang", True) and ph["weight_loading"] == 4.89
    build = [x for x in run.silences if x.likely]
    assert [(x.at, x.seconds) for x in build] == [(22.0, 182.0)]  # 17:43:20 Uvicorn running → 17:46:22 prefill
    assert build[0].after.startswith("INFO:     Uvicorn running on") and "FlashInfer's JIT build" in build[0].likely
    assert all(x.likely is None for x in run.silences if x.at < 22.0)


def test_vllm_cpu_real_log() -> None:
    run, ph = phases(VLLM_CPU)
    assert (run.engine, run.ready) == ("vllm", True)
    assert run.total_seconds == 21.0  # 20:09:19 → 20:09:40
    assert ph["weight_loading"] == 0.01  # no "Model loading took" on CPU: "Loading weights took 0.01 seconds"
    assert ph["kv_cache_alloc"] == 0.72  # eager: nothing to subtract from init engine
    assert ph["process_startup"] == 8.0 and ph["worker_spawn"] == 10.0
    assert "cuda_graph_capture" not in ph and "torch_compile" not in ph


def test_sglang_0523_wording() -> None:
    run, ph = phases(OURS / "sglang-0.5.23-tp2.log")
    assert run.ready and run.total_seconds == 45.0
    assert ph["dist_init"] == 2.35  # "Init parallel ends. elapsed=", TP1
    assert ph["weight_loading"] == 12.40
    assert ph["kv_cache_alloc"] == 1.30  # from "Engine startup timings (s): ... kv_cache_allocation=1.30"
    assert ph["cuda_graph_capture"] == 7.50  # "Capture target decode CUDA graph end. elapsed=7.50 s", TP1
    assert ph["piecewise_cuda_graph_capture"] == 9.05  # target prefill graphs
    assert ph["http_startup"] == 2.0 and ph["warmup"] == 3.0
    assert ph["unknown"] == pytest.approx(0.4, abs=1e-6)


def test_sglang_0510_ms_timestamps_and_load_end_without_elapsed() -> None:
    run, ph = phases(OURS / "sglang-0.5.10-ms-no-elapsed.log")
    assert run.ready and run.total_seconds == pytest.approx(22.0)  # across midnight
    assert ph["weight_loading"] == pytest.approx(4.25)  # timed from begin/end lines
    assert ph["kv_cache_alloc"] == pytest.approx(0.55)
    assert ph["cuda_graph_capture"] == 2.50 and ph["piecewise_cuda_graph_capture"] == 3.00
    assert ph["worker_spawn"] == pytest.approx(8.5)


def test_vllm_033_wording_and_new_year_wrap() -> None:
    run, ph = phases(OURS / "vllm-0.33-tp2.log")
    assert run.ready and run.total_seconds == 62.0  # 12-31 23:59:50 → 01-01 00:00:52
    assert ph["weight_loading"] == 7.80  # "Loading weights took 7.80 seconds" (TP1), not "Model loading took"
    assert ph["torch_compile"] == 15.20  # "torch.compile took 15.20 s in total"
    assert ph["cuda_graph_capture"] == 11.0
    assert ph["kv_cache_alloc"] == pytest.approx(33.0 - 15.20 - 11.0)
    assert ph["dist_init"] == 3.0  # world_size=... line → "rank R in world size 2 is assigned"
    assert ph["worker_spawn"] == 6.0


def test_mxlaunch_lines_and_truncated_start() -> None:
    run, ph = phases(OURS / "vllm-0.32-mxlaunch-staged.log")
    assert run.ready is False  # stops before "Application startup complete."
    assert run.total_seconds == 19.0  # up to the last line seen
    assert ph["weight_loading"] == 0.35  # mxlaunch's own figure wins over "Loading weights took 0.40"
    assert ph["stage"] == 2.10
    # stage overlaps start-up: not part of the sum that leaves `unknown`
    summed = sum(v for k, v in ph.items() if k not in ("stage", "unknown"))
    assert ph["unknown"] == pytest.approx(19.0 - summed)


def test_truncated_real_log_reports_the_phases_it_saw() -> None:
    text = SGLANG_TP4.read_text()
    cut = text[: text.index("Capture piecewise CUDA graph end")]
    run = profile_text(cut, source="cut")
    names = {p.name for p in run.phases}
    assert run.ready is False
    assert run.seconds("weight_loading") == 101.66 and run.seconds("cuda_graph_capture") == 17.13
    assert "http_startup" not in names and "warmup" not in names
    # cut inside the piecewise capture: it counts from its begin (08:07:17) to the last line seen (08:07:38)
    assert run.seconds("piecewise_cuda_graph_capture") == 21.0
    assert run.total_seconds == 159.0


def test_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_text("\n\n")
    other = tmp_path / "nginx.log"
    other.write_text('127.0.0.1 - - [29/Nov/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 612 "-" "curl/8.5"\n' * 3)
    for path in (empty, other, tmp_path / "missing.log", tmp_path):
        with pytest.raises(UsageError):
            profile_file(path)
    with pytest.raises(UsageError):  # an SGLang log read as vLLM has no vLLM lines
        profile_file(SGLANG_TP4, engine="vllm")


def test_auto_detect_is_not_fooled_by_vllm_lines_in_an_sglang_log() -> None:
    text = "INFO 07-03 08:04:50 [__init__.py:216] Automatically detected platform cuda.\n" + SGLANG_TP4.read_text()
    run = profile_text(text)
    assert run.engine == "sglang" and run.seconds("weight_loading") == 101.66


def test_incremental_feed_with_arrival_times() -> None:
    prof = StartupProfiler(engine="vllm", live=True)
    prof.feed("(APIServer pid=1) INFO 11-29 20:09:19 [api_utils.py:286] non-default args: {}", 0.5)
    events = prof.feed("(EngineCore pid=2) INFO 11-29 20:09:27 [core.py:133] Initializing a V1 LLM engine (v0.32.0)", 2.0)
    assert [e.name for e in events] == ["spawn"]
    prof.feed_text("(Worker pid=3) INFO 11-29 20:09:37 [default_loader.py:501] Loading weights took 1.25 seconds\nINFO:  ", 4.0)
    assert not prof.ready
    prof.feed_text("   Application startup complete.\n", 5.0)  # the line completes in the next chunk
    run = prof.result()
    assert run.ready and run.total_seconds == 5.0  # live: from process start to the ready line's arrival
    assert run.seconds("interpreter_startup") == 0.5  # spawn → the first line
    assert run.seconds("process_startup") == 1.5 and run.seconds("weight_loading") == 1.25  # → the engine core


def test_multinode_merge_takes_the_slowest_node_per_phase() -> None:
    merged = merge_nodes([profile_file(SGLANG_TP4), profile_file(SGLANG_WORKER)])
    assert merged.role == "server" and merged.ready
    assert merged.total_seconds == 171.0
    assert merged.seconds("dist_init") == 14.63  # from the worker node
    assert merged.seconds("weight_loading") == 101.66  # from the head node
    assert merged.seconds("piecewise_cuda_graph_capture") == 39.87


def test_stats_over_runs() -> None:
    runs = [profile_file(SGLANG_TP4), profile_file(OURS / "sglang-0.5.23-tp2.log")]
    stats = compute_stats(runs)
    wl = stats["weight_loading"]
    assert wl["n"] == 2 and wl["min"] == 12.40 and wl["max"] == 101.66
    assert wl["mean"] == pytest.approx((101.66 + 12.40) / 2, abs=1e-3)
    assert wl["std"] == pytest.approx(abs(101.66 - 12.40) / 2**0.5, abs=1e-3)
    assert stats["total_seconds"]["mean"] == pytest.approx(108.0)
    doc = report(runs)
    assert [p["name"] for p in doc["runs"][0]["phases"]] == [n for n in PHASES if n in {p["name"] for p in doc["runs"][0]["phases"]}]
    assert set(doc["runs"][0]) == {"source", "engine", "role", "ready", "total_seconds", "phases", "silences"}
