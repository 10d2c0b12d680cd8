"""The one redaction (mxlaunch/safety/redact.py): each URL form, each flag form, both engines' secret flags from their own
option tables, known values in free text and in a byte stream — and nothing else altered."""

from __future__ import annotations

import pytest

from mxlaunch.coord.peers import redact_url as peers_redact_url
from mxlaunch.engines import sglang_flags, vllm_flags
from mxlaunch.safety.redact import (MASK, Scrubber, names_secret, redact, redact_argv, redact_env, redact_text, redact_url,
                             secret_flags, secret_values)

PW = "s3cr3t-Pa55"


@pytest.mark.parametrize("url,want", [
    (f"redis://:{PW}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    (f"rediss://user:{PW}@h:6380/2", "rediss://user:***@h:6380/2"),
    (f"https://{PW}@github.com/org/repo", "https://***@github.com/org/repo"),
    (f"redis://h:6379/0?password={PW}&db=1", "redis://h:6379/0?password=***&db=1"),
    (f"https://h/x?token={PW}", "https://h/x?token=***"),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Credential=AK&X-Amz-Signature={PW}&X-Amz-Expires=60#f",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60#f"),
    (f"https://h/x?api_key={PW}&access_token={PW}", "https://h/x?api_key=***&access_token=***"),
    (f"redis://u:{PW.replace('-', '%2D')}@[::1]:6379", "redis://u:***@[::1]:6379"),
])
def test_each_url_form_loses_its_secret_and_nothing_else(url: str, want: str) -> None:
    assert redact_url(url) == want
    assert peers_redact_url(url) == want  # coord's redact_url is this one
    assert "Pa55" not in redact_text(f"cannot reach {url}: refused")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "file:/lustre/store", "s3://bucket/models/m?versionId=3",
                                 "https://h/x?tokens=5&max_tokens=10&keyfile=a", "/plain/path"])
def test_urls_without_secrets_are_unchanged(url: str) -> None:
    assert redact_url(url) == url and redact_text(url) == url


def _table_secrets(table: dict[str, str]) -> set[str]:
    return {f for f, arity in table.items() if arity != "0" and names_secret(f)}


def test_both_engines_secret_flags_come_from_their_tables() -> None:
    vllm, sglang = _table_secrets(vllm_flags.OPTIONS), _table_secrets(sglang_flags.OPTIONS)
    assert {"--api-key", "--hf-token"} <= vllm and {"--api-key", "--admin-api-key", "--ssl-keyfile-password"} <= sglang
    assert vllm | sglang <= secret_flags()
    for ok in ("--ssl-keyfile", "--max-num-batched-tokens", "--long-prefill-token-threshold", "--tokenizer",
               "--kt-max-deferred-experts-per-token", "--bucket-time-to-first-token", "--speculative-token-map"):
        assert ok not in secret_flags(), ok


@pytest.mark.parametrize("flag", sorted(_table_secrets(vllm_flags.OPTIONS) | _table_secrets(sglang_flags.OPTIONS))
                         + ["--token", "--watermark-config"])
def test_every_secret_flag_is_masked_in_both_forms(flag: str) -> None:
    argv = ["vllm", "serve", "/models/m", flag, PW, "--port", "8000"]
    assert redact_argv(argv) == ["vllm", "serve", "/models/m", flag, MASK, "--port", "8000"]
    assert redact_argv(["x", f"{flag}={PW}", "--port=8000"]) == ["x", f"{flag}={MASK}", "--port=8000"]
    assert PW not in redact_text(" ".join(argv)) and PW not in redact_text(f"x {flag}={PW} y")


def test_list_flags_underscores_and_abbreviations() -> None:
    # vLLM's --api-key takes several keys; vLLM reads --api_key too; argparse takes an unambiguous abbreviation
    assert redact_argv(["vllm", "serve", "m", "--api-key", "k1xx", "k2xx", "--tp", "2"]) == \
        ["vllm", "serve", "m", "--api-key", MASK, MASK, "--tp", "2"]
    assert redact_argv(["--api_key", PW, "--hf-tok", PW]) == ["--api_key", MASK, "--hf-tok", MASK]


def test_nothing_else_is_altered() -> None:
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "-tp", "2", "--ssl-keyfile", "k.pem",
            "--max-num-batched-tokens", "4096", "--registry", "redis://h:1/0", "--hf-overrides", '{"a": 1}', "--"]
    assert redact_argv(argv) == argv
    doc = {"key": "0123abcd", "source_id": "ab", "argv": argv, "n": 3, "ok": True, "files": ["/a", "/b"]}
    assert redact(doc) == doc  # a bare "key" is mxlaunch's cache key


def test_documents_environments_and_known_values() -> None:
    doc = {"event": "plan", "argv": ["vllm", "serve", "m", "--api-key", PW],
           "p2p": {"registry": f"redis://:{PW}@h:1/0"}, "password": PW, "hf_token": PW,
           "reason": f"in redis://:{PW}@h:1/0", "nested": [{"message": f"saw {PW} in a line"}]}
    assert PW not in repr(redact(doc, [PW]))
    assert redact(doc)["nested"][0]["message"] == f"saw {PW} in a line"  # free text: only known values go
    env = redact_env({"HF_TOKEN": PW, "VLLM_API_KEY": PW, "OMP_NUM_THREADS": "4", "REDIS": f"redis://:{PW}@h"})
    assert env == {"HF_TOKEN": MASK, "VLLM_API_KEY": MASK, "OMP_NUM_THREADS": "4", "REDIS": "redis://:***@h"}


def test_secret_values_of_a_launch() -> None:
    argv = ["vllm", "serve", "m", "--api-key", "sk-argv-key", "--hf-token=hf_flag_tok", "--port", "8000"]
    env = {"HF_TOKEN": "hf_env_token", "MXLAUNCH_REGISTRY": "redis://:envpass1@h/0", "PATH": "/usr/bin",
           "SOME_KEY": "1", "OMP_NUM_THREADS": "4"}
    got = secret_values(argv, env, [f"redis://:{PW}@h:1/0?token=qtoken1", None])
    assert got == {"sk-argv-key", "hf_flag_tok", "hf_env_token", "envpass1", PW, "qtoken1"}


def test_scrubber_catches_a_value_cut_between_chunks() -> None:
    s = Scrubber([PW])
    text = f"INFO server_args={{'api_key': '{PW}', 'port': 8000}}\nnext line {PW}".encode()
    for cut in range(len(text) + 1):  # every place the pipe could split it
        s = Scrubber([PW])
        out = s.feed(text[:cut]) + s.feed(text[cut:]) + s.end()
        assert out == text.replace(PW.encode(), MASK.encode()), cut
    assert Scrubber([]).feed(b"as is") == b"as is"
