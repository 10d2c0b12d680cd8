"""`mxlaunch profile` on log files: JSON contract, exit codes, one-line errors, chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "logs"  # real logs, copied into the repository
OURS = Path(__file__).resolve().parent / "fixtures_logs"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxlaunch.cli", "profile", *args], capture_output=True, text=True)


def test_json_for_one_real_log() -> None:
    result = run_cli("--log", str(REAL / "sglang-0.5.x-apertus8b-tp4-gpu.log"), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # one JSON document, nothing else on stdout
    assert doc["schema"] == 1
    (run,) = doc["runs"]
    assert run["engine"] == "sglang" and run["role"] == "server" and run["ready"] is True
    ph = {p["name"]: p["seconds"] for p in run["phases"]}
    assert ph["weight_loading"] == 101.66 and ph["piecewise_cuda_graph_capture"] == 21.42
    assert doc["stats"]["weight_loading"] == {"mean": 101.66, "std": 0.0, "min": 101.66, "max": 101.66, "n": 1}


def test_several_logs_are_several_runs_and_multinode_merges_them() -> None:
    head, worker = REAL / "sglang-0.5.x-apertus8b-tp4-gpu.log", REAL / "sglang-0.5.x-llama70b-tp8-2node-worker.log"
    runs = json.loads(run_cli("--log", str(head), str(worker), "--json").stdout)["runs"]
    assert [r["role"] for r in runs] == ["server", "worker"]
    merged = run_cli("--log", str(head), "--log", str(worker), "--multinode", "--json")
    assert merged.returncode == 0
    (run,) = json.loads(merged.stdout)["runs"]
    assert run["ready"] is True and run["total_seconds"] == 171.0
    assert {p["name"]: p["seconds"] for p in run["phases"]}["dist_init"] == 14.63


def test_table_output_names_the_phases() -> None:
    result = run_cli("--log", str(REAL / "vllm-0.32-cpu-tiny-llama.log"))
    assert result.returncode == 0
    assert "weight_loading" in result.stdout and "kv_cache_alloc" in result.stdout and "21.00" in result.stdout


def test_truncated_log_is_a_profile_with_exit_1() -> None:
    result = run_cli("--log", str(OURS / "vllm-0.32-mxlaunch-staged.log"), "--json")
    assert result.returncode == 1
    (run,) = json.loads(result.stdout)["runs"]
    assert run["ready"] is False
    assert "never reached ready" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("content", ["", "hello from another program\nnothing to see\n"])
def test_bad_input_exit_2_one_line(tmp_path: Path, content: str) -> None:
    path = tmp_path / "x.log"
    path.write_text(content)
    result = run_cli("--log", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_file_and_bad_engine_exit_2(tmp_path: Path) -> None:
    for args in (("--log", str(tmp_path / "nope.log")), ("--log", str(REAL / "vllm-0.32-cpu-tiny-llama.log"), "--engine", "tgi"), ()):
        result = run_cli(*args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_chart_writes_a_png_or_says_how_to_install(tmp_path: Path) -> None:
    png = tmp_path / "phases.png"
    result = run_cli("--log", str(REAL / "vllm-0.11.0-gpu-qwen3-vl-30b-a3b-tp4.log"), "--log",
                     str(OURS / "vllm-0.33-tp2.log"), "--chart", str(png), "--json")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.returncode == 2 and "pip install 'mxlaunch[chart]'" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
