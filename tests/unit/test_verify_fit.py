"""verify fits its prompts to the server's context: cut on a token boundary with the server's tokenizer,
recorded as the token ids sent, replayed exactly; a server too small for every prompt is exit 2.

The fake servers (tests/helpers/fake_servers.py) tokenize one id per UTF-8 byte plus BOS and enforce their
`max_model_len` as the engines do (vLLM refuses a prompt that does not fit and shortens max_tokens silently;
SGLang refuses prompt + max_new_tokens over the context).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxlaunch.verify import run as verify
from mxlaunch.errors import UsageError
from mxlaunch.verify.prompts import load_prompts
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.fake_servers import FakeEngine, toy_detokenize, toy_tokenize

LEN = 300  # the fake server's max_model_len
MAX_TOKENS = 32
BUDGET = LEN - MAX_TOKENS  # 268 (vLLM): the built-in "repetition" (595 tokens) and "long-prose" (4034) do not fit
SGLANG_BUDGET = BUDGET - 2  # SGLang keeps 2 tokens of its context (max_req_len = context - 1; new tokens < it)


def sent_prompts(engine: FakeEngine, path: str) -> list:
    key = "prompt" if path == "/v1/completions" else None
    return [body[key] if key else body.get("input_ids", body.get("text"))
            for method, p, body in engine.requests if method == "POST" and p == path]


@pytest.mark.parametrize("api, path, budget", [("vllm", "/v1/completions", BUDGET), ("sglang", "/generate", SGLANG_BUDGET)])
def test_long_prompts_are_cut_recorded_as_ids_and_replayed_exactly(tmp_path: Path, api: str, path: str,
                                                                   budget: int) -> None:
    prompts = load_prompts(None)
    with FakeEngine(api=api, max_model_len=LEN, tokenize=True) as engine:
        gold = verify.record(engine.url, prompts, max_tokens=MAX_TOKENS)
        sent = sent_prompts(engine, path)
    by_name = {p["name"]: p for p in gold["prompts"]}
    assert [c["name"] for c in gold["fit"]["cut"]] == ["long-prose", "repetition"]
    assert gold["fit"]["prompt_budget"] == budget
    for original in prompts:
        p, ids = by_name[original["name"]], toy_tokenize(original["text"])
        assert len(p["output"]) == MAX_TOKENS  # room was left for every generated token
        if len(ids) <= budget:
            assert p["text"] == original["text"] and "input_ids" not in p  # sent as text, as before
            continue
        assert p["input_ids"] == ids[:budget] and p["cut_from_tokens"] == len(ids)
        assert [row[0] for row in p["prompt"]] == ids[:budget]  # the server saw exactly those tokens
        assert p["text"] == toy_detokenize(ids[:budget])  # for people: the text of the kept tokens
    assert [s for s in sent if isinstance(s, list)] == [by_name["long-prose"]["input_ids"], by_name["repetition"]["input_ids"]]

    path_gold = tmp_path / "gold.json"
    verify.write_gold(path_gold, gold)
    again = verify.read_gold(path_gold)
    assert again["prompts"] == gold["prompts"] and again["fit"] == gold["fit"]
    with FakeEngine(api=api, max_model_len=LEN, tokenize=True) as same:
        report = verify.compare(same.url, again)
        replayed = sent_prompts(same, path)
    assert report["pass"] and report["max_delta"] == 0.0
    assert replayed == sent  # compare sends exactly what record sent: ids for the cut prompts
    with FakeEngine(api=api, max_model_len=LEN, tokenize=True, perturb_token_at=3) as other:
        report = verify.compare(other.url, again)
    assert not report["pass"] and report["worst"]["kind"] == "token_id"


def test_cli_records_with_a_one_line_note_and_compares(tmp_path: Path) -> None:
    gold = tmp_path / "gold.json"
    with FakeEngine(api="vllm", max_model_len=LEN, tokenize=True) as engine:
        result = run_cli("verify", "--url", engine.url, "--record", str(gold), "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["cut"] == [
            {"name": "long-prose", "tokens": 4034, "kept": BUDGET}, {"name": "repetition", "tokens": 595, "kept": BUDGET}]
        notes = [line for line in result.stderr.splitlines() if line.strip()]
        assert notes == [f"note: cut 2 of 18 prompts to fit the server's context (max_model_len {LEN}, max_tokens "
                         f"{MAX_TOKENS}: {BUDGET} tokens a prompt): long-prose 4034 → {BUDGET} tokens, repetition 595 → "
                         f"{BUDGET} tokens"]
        compared = run_cli("verify", "--url", engine.url, "--compare", str(gold))
        assert compared.returncode == 0, compared.stderr
    with FakeEngine(api="vllm", max_model_len=LEN, tokenize=True, perturb_logprob=1e-3) as drift:
        assert run_cli("verify", "--url", drift.url, "--compare", str(gold)).returncode == 1


def test_prompts_that_fit_are_not_touched() -> None:
    prompts = load_prompts(None)
    with FakeEngine(api="vllm", max_model_len=8192, tokenize=True) as engine:
        gold = verify.record(engine.url, prompts, max_tokens=MAX_TOKENS)
    assert gold["fit"]["cut"] == [] and verify.fit_note(gold) is None
    assert [p["text"] for p in gold["prompts"]] == [p["text"] for p in prompts]
    assert not any("input_ids" in p for p in gold["prompts"])


def test_a_server_too_small_for_every_prompt_is_exit_2(tmp_path: Path) -> None:
    prompts_file = tmp_path / "p.json"
    prompts_file.write_text(json.dumps(["a prompt of some forty bytes, give or take", "and another one, also long"]))
    with FakeEngine(api="vllm", max_model_len=40, tokenize=True) as engine:
        with pytest.raises(UsageError, match="too small for every prompt"):
            verify.record(engine.url, load_prompts(prompts_file), max_tokens=MAX_TOKENS)
        result = run_cli("verify", "--url", engine.url, "--record", str(tmp_path / "g.json"), "--prompts", str(prompts_file))
        assert result.returncode == 2
        line = one_line_error(result)
        assert "shortest prompt 'p001' has 27" in line and "--max-model-len" in line
        result = run_cli("verify", "--url", engine.url, "--record", str(tmp_path / "g.json"), "--max-tokens", "39")
        assert result.returncode == 2
        assert "--max-tokens 39 leaves 1 tokens" in one_line_error(result)
    assert not (tmp_path / "g.json").exists()


def test_without_tokenize_prompts_are_sent_as_given_and_a_refusal_is_still_exit_2(tmp_path: Path) -> None:
    with FakeEngine(api="vllm", max_model_len=LEN) as engine:  # an older server: no /tokenize
        result = run_cli("verify", "--url", engine.url, "--record", str(tmp_path / "g.json"))
    assert result.returncode == 2
    assert "server refused prompt 'long-prose'" in one_line_error(result)
    with FakeEngine(api="sglang", max_model_len=LEN) as engine:
        gold = verify.record(engine.url, load_prompts(None)[:3], max_tokens=MAX_TOKENS)
    assert verify.fit_note(gold).startswith("prompts not fitted to the server's context (max_model_len 300): /tokenize")


def test_malformed_input_ids_are_refused(tmp_path: Path) -> None:
    with FakeEngine(api="vllm", max_model_len=LEN, tokenize=True) as engine:
        gold = verify.record(engine.url, load_prompts(None), max_tokens=MAX_TOKENS)
    path = tmp_path / "g.json"
    verify.write_gold(path, gold)
    text = path.read_text()
    assert '"input_ids": [' in text  # one line per cut prompt
    path.write_text(text.replace('"input_ids": [', '"input_ids": ["x",', 1))
    with pytest.raises(UsageError, match="input_ids is not a non-empty list of token ids"):
        verify.read_gold(path)
