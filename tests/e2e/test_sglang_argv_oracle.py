"""SGLang's own parser is the oracle: for each command line, every field mxlaunch reads must equal what
SGLang 0.5.23's argparse (with its ConfigArgumentMerger for --config) makes of the same argv, and an argv
SGLang refuses must be refused. Also: the carried option table has not drifted from SGLang's parser."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mxlaunch.engines.sglang_argv import FIELDS, _effective, _split_command, _values
from mxlaunch.errors import UsageError
from tests.helpers.sglang_server import REPO, sglang_python

pytestmark = pytest.mark.live_setup  # SGLang's venv / the CRIU kit (tests/helpers/live_setup.py)

ORACLE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
out = []
for argv in json.loads(sys.stdin.read()):
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        if "--config" in argv:
            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        ns, rest = parser.parse_known_args(argv)
        if rest:
            raise ValueError(f"unrecognized {rest}")
        out.append({"ok": True, "values": {k: v for k, v in vars(ns).items()}})
    except (argparse.ArgumentError, ValueError, SystemExit) as exc:
        out.append({"ok": False, "error": str(exc)})
print(json.dumps(out, default=str))
"""


def oracle(argvs: list[list[str]]) -> list[dict]:
    python = sglang_python()
    if not python.exists():
        pytest.fail(f"needs SGLang's venv at {python} — run `make sglang-venv`")
    proc = subprocess.run([str(python), "-c", ORACLE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ours(argv: list[str]) -> dict:
    full = ["python", "-m", "sglang.launch_server", *argv]
    _, start = _split_command(full)
    return _values(_effective(full, start, "python -m sglang.launch_server"))


def test_every_field_matches_sglangs_parser(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tp-size: 4\npp-size: 2\nport: 31000\ntrust-remote-code: true\n"
                   "json-model-override-args: {rope_theta: 1000}\n")
    cases = [
        ["--model-path", "/m"],
        ["--model", "/m", "--tp", "4", "--dp", "2", "--ep", "2"],
        ["--model-path=/m", "--tensor-parallel-size=8", "--pipeline-parallel-size", "2", "--data-parallel-size", "2"],
        ["--model-path", "/m", "--config", str(cfg), "--tp-size", "2"],
        ["--model-path", "/m", "--nnodes", "2", "--node-rank", "1", "--nccl-init-addr", "h:5000", "--dtype", "float32"],
        ["--model-path", "/m", "--quantization", "fp8", "--load-format", "safetensors", "--port", "1234",
         "--host", "0.0.0.0", "--served-model-name", "x", "--revision", "abc"],
        ["--model-path", "/m", "--enable-dp-attention", "--dp-size", "4", "--tp-size", "4", "--attn-cp-size", "2"],
        ["--model-path", "/m", "--enable-lora", "--lora-paths", "a", "b", "--speculative-algorithm", "EAGLE",
         "--speculative-draft-model", "/d", "--use-ray", "--device", "cpu"],
        ["--model-path", "/m", "--model-loader-extra-config", '{"enable_multithread_load": true}',
         "--moe-runner-backend", "triton", "--ep-num-redundant-experts", "32", "--init-expert-location", "x.json"],
        ["--model-path", "/m", "--random-seed", "-1", "--trust-remote-code", "--tp-size", "2"],
    ]
    answers = oracle(cases)
    for argv, answer in zip(cases, answers):
        assert answer["ok"], (argv, answer)
        mine = ours(argv)
        for dest in FIELDS:
            theirs = answer["values"][dest]
            assert str(mine[dest]) == str(theirs), (argv, dest, mine[dest], theirs)


def test_what_sglang_refuses_mxlaunch_refuses(tmp_path: Path) -> None:
    cases = [
        ["--model-path", "/m", "--pp", "2"],  # ambiguous prefix in 0.5.23
        ["--model-path", "/m", "--no-such-flag"],
        ["--model-path", "/m", "--tp-size"],
        ["--model-path", "/m", "stray"],
    ]
    for argv, answer in zip(cases, oracle(cases)):
        assert not answer["ok"], (argv, answer)
        with pytest.raises(UsageError):
            ours(argv)


def test_the_option_table_matches_the_installed_sglang() -> None:
    python = sglang_python()
    proc = subprocess.run([str(python), str(REPO / "scripts" / "kits" / "gen_sglang_flags.py")], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    carried = (REPO / "mxlaunch" / "engines" / "sglang_flags.py").read_text()
    assert proc.stdout == carried, "SGLang's options changed: regenerate mxlaunch/engines/sglang_flags.py"


def test_config_keys_sglang_refuses_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lora-paths: [a, b]\n")
    argv = ["--model-path", "/m", "--config", str(cfg)]
    assert not oracle([argv])[0]["ok"]
    with pytest.raises(UsageError, match="lora-paths"):
        ours(argv)
