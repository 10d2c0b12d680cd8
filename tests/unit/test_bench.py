"""bench without an engine: statistics, the SSE/HTTP parser on a real vLLM stream, and whole runs
against a local fake streaming server with known delays."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mxlaunch.bench import client as bench_http  # noqa: E402
from mxlaunch.bench import run as bench  # noqa: E402
from mxlaunch.errors import UsageError  # noqa: E402
from tests.helpers.cli import one_line_error, run_cli  # noqa: E402
from tests.helpers.fake_servers import FakeEngine  # noqa: E402
from tests.helpers.vllm_server import free_port  # noqa: E402

DATA = REPO / "tests" / "helpers" / "data"


def test_percentiles_match_numpy_linear() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert bench.percentile(xs, 50) == pytest.approx(50.5)
    assert bench.percentile(xs, 90) == pytest.approx(90.1)
    assert bench.percentile(xs, 99) == pytest.approx(99.01)
    assert bench.percentile([3.0], 99) == 3.0 and bench.percentile([], 50) is None
    s = bench.stats_ms([0.001, 0.003])
    assert s["p50"] == pytest.approx(2.0) and s["mean"] == pytest.approx(2.0) and s["n"] == 2


def _parse(raw: bytes, pieces: list[int]) -> bench.RequestResult:
    async def go() -> bench.RequestResult:
        resp = bench_http._Response(asyncio.get_running_loop())
        pos, now = 0, 1.0
        for n in pieces + [len(raw)]:
            if pos >= len(raw):
                break
            resp.feed(raw[pos : pos + n], now)
            pos += n
            now += 0.01
        if not resp.future.done():
            resp.lost(None, now)
        return resp.future.result()

    return asyncio.run(go())


def test_parser_on_a_real_vllm_stream_in_any_split() -> None:
    raw = (DATA / "vllm_stream_response.bin").read_bytes()  # 5 tokens, usage, [DONE], chunked
    whole = _parse(raw, [len(raw)])
    assert whole.ok and whole.output_tokens == 5 and whole.chunks == 5 and whole.prompt_tokens == 4
    assert whole.itls == [0.0] * 4  # all arrived in one piece: no gaps
    for size in (1, 7, 64):
        r = _parse(raw, [size] * (len(raw) // size + 1))
        assert r.ok and r.output_tokens == 5 and r.chunks == 5 and len(r.itls) == 4
        assert all(x >= 0 for x in r.itls)


def test_parser_errors() -> None:
    raw = (DATA / "vllm_stream_response.bin").read_bytes()
    cut = _parse(raw[: len(raw) // 2], [10_000])
    assert not cut.ok and "closed" in cut.error
    body = b'{"error":{"message":"max_tokens too big","code":400}}'
    err = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body), body)
    r = _parse(err, [len(err)])
    assert not r.ok and r.error == "HTTP 400: max_tokens too big"
    events = b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    sse_err = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(events), events)
    r = _parse(sse_err, [len(sse_err)])
    assert not r.ok and "boom" in r.error


def test_run_against_a_fake_stream_with_known_delays() -> None:
    with FakeEngine(api="vllm", first_token_delay_s=0.03, token_delay_s=0.01) as engine:
        result = bench.run_bench(engine.url, requests=4, concurrencies=[1, 2], input_len=16, output_len=6)
    assert result["api"] == "vllm" and result["warmup"]["ok"]
    assert result["input_len_exact"] is False  # the fake has no /tokenize: text prompts
    for lv in result["levels"]:
        assert lv["completed"] == 4 and lv["errors"] == 0
        assert lv["output_tokens_per_request"] == {"min": 6, "max": 6}
        # lower bounds only: the server's delays (a loaded machine can make any of them longer, never shorter)
        assert 28 <= lv["ttft_ms"]["p50"]
        assert 8 <= lv["itl_ms"]["p50"] and lv["itl_ms"]["n"] == 4 * 5
        assert lv["e2e_ms"]["p50"] >= 30 + 5 * 9 and lv["e2e_ms"]["p50"] > lv["ttft_ms"]["p50"]
        # each request's e2e runs at least to its last token (ttft + its gaps): so do the means
        gaps_per_request = lv["itl_ms"]["mean"] * lv["itl_ms"]["n"] / lv["completed"]
        assert lv["e2e_ms"]["mean"] >= lv["ttft_ms"]["mean"] + gaps_per_request - 1e-6
        assert 0 <= lv["client_cpu_share"] < 1


def test_errors_are_counted_not_fatal() -> None:
    with FakeEngine(api="vllm", fail_completions_every=3) as engine:
        result = bench.run_bench(engine.url, requests=9, concurrencies=[1], input_len=8, output_len=3, warmup=False)
    lv = result["levels"][0]
    assert lv["errors"] == 3 and lv["completed"] == 6 and lv["error_samples"] == ["HTTP 500: engine hiccup"]


def test_the_run_is_bounded_in_time() -> None:
    with FakeEngine(api="vllm", token_delay_s=0.5) as engine:
        result = bench.run_bench(engine.url, requests=4, concurrencies=[2], output_len=20, max_duration=1.0,
                                 warmup=False)  # 20 tokens × 0.5 s each: only the cut ends it within 1 s
    lv = result["levels"][0]
    assert lv["errors"] == 4 and "--max-duration" in lv["error_samples"][0]
    with FakeEngine(api="vllm", token_delay_s=0.5) as engine:
        result = bench.run_bench(engine.url, requests=1, output_len=20, timeout=0.3, warmup=False)
    assert "timed out" in result["levels"][0]["error_samples"][0]


def test_dataset_file(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('"a prompt"\n{"prompt": "another"}\n')
    with FakeEngine(api="vllm") as engine:
        result = bench.run_bench(engine.url, requests=3, dataset=str(path), output_len=2, warmup=False)
        sent = [b["prompt"] for m, p, b in engine.requests if p == "/v1/completions"]
    assert sent == ["a prompt", "another", "a prompt"] and result["dataset"] == str(path)


@pytest.mark.parametrize("args, needle", [
    (["--concurrency", "2", "--sweep", "1,2"], "exclude each other"),
    (["--sweep", "1,x"], "--sweep"),
    (["--sweep", "0"], "--sweep"),
    (["--requests", "0"], "--requests"),
    (["--dataset", "/nonexistent.jsonl"], "--dataset"),
])
def test_cli_usage_errors(args: list[str], needle: str) -> None:
    r = run_cli("bench", "--url", "http://127.0.0.1:9", *args)
    assert r.returncode == 2
    assert needle in one_line_error(r)


def test_cli_json_and_unreachable() -> None:
    with FakeEngine(api="sglang") as engine:
        r = run_cli("bench", "--url", engine.url, "--requests", "3", "--output-len", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["schema"] == 1 and out["api"] == "sglang" and out["levels"][0]["completed"] == 3
    r = run_cli("bench", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 2 and "cannot reach server" in one_line_error(r)


def test_bad_arguments_raise_usage_errors() -> None:
    with pytest.raises(UsageError):
        bench.parse_sweep("")
    with pytest.raises(UsageError):
        bench.run_bench("http://127.0.0.1:9", timeout=0)
