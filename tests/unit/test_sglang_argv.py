"""SGLang command lines without SGLang: forms, aliases and argparse abbreviations on SGLang's own option
table, --config merging, placement per `_calculate_rank_ranges`, rewrite, guards, and launch --dry-run.
(The same argv are checked against SGLang's real parser in tests/e2e/test_sglang_argv_oracle.py.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mxlaunch.engines.registry import detect_engine
from mxlaunch.engines.sglang_argv import parse_sglang_argv, rewrite_sglang_argv
from mxlaunch.engines.sglang_engine import local_ranks, rank_ranges, snapshot_format_refusal
from mxlaunch.errors import UsageError
from tests.helpers.cli import run_cli

SERVER = ["python", "-m", "sglang.launch_server"]


def checkpoint(folder: Path, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    return folder


def parse(*args: str):
    return parse_sglang_argv([*SERVER, *args], engine_version="0.5.23")


def test_forms_are_detected() -> None:
    assert detect_engine([*SERVER, "--model-path", "m"]) == "sglang"
    assert detect_engine(["sglang", "serve", "m"]) == "sglang"
    assert detect_engine(["python3.11", "-m", "sglang.launch_server"]) == "sglang"
    assert detect_engine(["sglang", "generate"]) is None
    assert detect_engine(["python", "-m", "sglang.bench_serving"]) is None


@pytest.mark.parametrize("args,tp,pp,dp,ep", [
    (["--tp-size", "4"], 4, 1, 1, 1),
    (["--tensor-parallel-size=4"], 4, 1, 1, 1),
    (["--tp", "4"], 4, 1, 1, 1),  # a unique prefix of --tp-size: argparse accepts it
    (["--pp-size", "2", "--pipeline-parallel-size", "3"], 1, 3, 1, 1),  # the last one wins
    (["--dp", "2", "--ep", "2", "--tp", "2"], 2, 1, 2, 2),
    (["--data-parallel-size=2", "--expert-parallel-size", "4"], 1, 1, 2, 4),
])
def test_parallel_aliases(tmp_path: Path, args: list[str], tp: int, pp: int, dp: int, ep: int) -> None:
    spec = parse("--model-path", str(checkpoint(tmp_path / "m")), *args)
    assert (spec.tp, spec.pp, spec.dp, spec.ep) == (tp, pp, dp, ep)
    assert spec.expert_parallel is (ep > 1)


def test_model_alias_and_defaults(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    spec = parse("--model", str(model), "--dtype=float32")
    assert spec.model_path == str(model.resolve()) and spec.dtype == "float32"
    assert spec.port == 30000 and spec.host == "127.0.0.1" and spec.served_model_name == str(model)
    assert spec.engine == "sglang" and spec.safe, spec.unsafe_reasons


def test_sglang_serve_takes_the_model_positionally_and_drops_model_type(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    spec = parse_sglang_argv(["sglang", "serve", str(model), "--model-type", "llm", "--tp", "2"], engine_version="x")
    assert spec.model == str(model) and spec.tp == 2 and spec.launch_form == "sglang serve"


def test_config_file_is_merged_under_the_command_line(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model-path: {model}\ntp-size: 4\npp-size: 2\ntrust-remote-code: true\nport: 31000\n")
    spec = parse("--config", str(cfg), "--tp-size", "2")
    assert (spec.tp, spec.pp, spec.port) == (2, 2, 31000)  # command line > config > defaults


@pytest.mark.parametrize("args,needle", [
    (["--pp", "2"], "ambiguous"),  # --pp-size, --pp-max-micro-batch-size, --pp-async-batch-depth
    (["--tp-size", "0"], "at least 1"),
    (["--tp-size", "two"], "whole number"),
    (["--no-such-flag", "1"], "not an SGLang"),
    (["stray"], "positional"),
    (["--tp-size"], "needs a value"),
    (["--nnodes", "2"], "--dist-init-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "node rank"),
])
def test_bad_input_is_a_one_line_usage_error(tmp_path: Path, args: list[str], needle: str) -> None:
    with pytest.raises(UsageError) as err:
        parse("--model-path", str(checkpoint(tmp_path / "m")), *args)
    assert needle in err.value.one_line()


def test_config_with_underscore_keys_is_refused_as_sglang_refuses_it(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tp_size: 2\n")
    with pytest.raises(UsageError, match="--tp_size"):
        parse("--model-path", str(checkpoint(tmp_path / "m")), "--config", str(cfg))


@pytest.mark.parametrize("args,needle", [
    (["--load-format", "gguf"], "--load-format gguf"),
    (["--enable-lora"], "LoRA"),
    (["--speculative-algorithm", "EAGLE"], "speculative"),
    (["--use-ray"], "Ray"),
    (["--device", "npu"], "--device npu"),
    (["--startup-weight-load-mode", "overlap"], "startup-weight-load-mode"),
])
def test_what_mxlaunch_cannot_serve_safely_is_named(tmp_path: Path, args: list[str], needle: str) -> None:
    spec = parse("--model-path", str(checkpoint(tmp_path / "m")), *args)
    assert not spec.safe and any(needle in r for r in spec.unsafe_reasons), spec.unsafe_reasons


def test_layout_settings_enter_the_identity(tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "m"))
    plain = parse("--model-path", model)
    attn = parse("--model-path", model, "--tp", "4", "--dp-size", "4", "--enable-dp-attention")
    assert plain.layout_extras == {}
    assert attn.layout_extras == {"attn_dp_size": 4} and attn.dp == 1  # attention DP is not a replica


@pytest.mark.parametrize("tp,pp,nnodes,node_rank,pp_ranks,tp_ranks", [
    (8, 1, 1, 0, [0], list(range(8))),
    (8, 1, 2, 1, [0], [4, 5, 6, 7]),  # TP across two nodes
    (4, 2, 2, 1, [1], [0, 1, 2, 3]),  # PP across nodes: node 1 hosts the second stage
    (4, 2, 4, 3, [1], [2, 3]),  # TP×PP over four nodes
    (2, 4, 2, 0, [0, 1], [0, 1]),  # two stages per node
])
def test_rank_ranges_follow_sglangs_arithmetic(tp: int, pp: int, nnodes: int, node_rank: int,
                                               pp_ranks: list[int], tp_ranks: list[int]) -> None:
    got_pp, got_tp = rank_ranges(tp, pp, nnodes, node_rank)
    assert list(got_pp) == pp_ranks and list(got_tp) == tp_ranks


def test_local_ranks_with_dp_replicas_share_snapshot_ranks(tmp_path: Path) -> None:
    spec = parse("--model-path", str(checkpoint(tmp_path / "m")), "--tp", "2", "--dp", "2")
    ranks = local_ranks(spec)
    assert [(r["rank"], r["dp_rank"], r["tp_rank"], r["snapshot_rank"]) for r in ranks] == [
        (0, 0, 0, 0), (1, 0, 1, 1), (2, 1, 0, 0), (3, 1, 1, 1)]


def test_rewrite_replaces_every_spelling_in_place(tmp_path: Path) -> None:
    spec = parse("--model-path", str(checkpoint(tmp_path / "m")), "--load-format=auto", "--port", "1", "--load-format", "safetensors")
    out = rewrite_sglang_argv(spec, set_flags={"--load-format": "sharded_state", "--nnodes": "2"})
    assert out.count("--load-format") == 1 and out[out.index("--load-format") + 1] == "sharded_state"
    assert "--load-format=auto" not in out and out[-2:] == ["--nnodes", "2"]
    assert out.index("--load-format") < out.index("--port")  # takes the first occurrence's place


@pytest.mark.parametrize("config,args,needle", [
    ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, [], "kv_b_proj"),
    ({"architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}, [], "mxfp4"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, ["--quantization", "modelopt_fp4"], "NVFP4"),
    ({"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gptq", "desc_act": True}},
     [], "act-order"),
])
def test_stock_formats_are_refused_where_they_lose_weights(tmp_path: Path, config: dict, args: list[str],
                                                           needle: str) -> None:
    spec = parse("--model-path", str(checkpoint(tmp_path / "m", config)), *args)
    assert snapshot_format_refusal(spec, "raw") is None
    for fmt in ("sharded_state", "presharded"):
        reason = snapshot_format_refusal(spec, fmt)
        assert reason is not None and needle in reason, reason


def test_plain_dense_model_may_use_stock_formats(tmp_path: Path) -> None:
    spec = parse("--model-path", str(checkpoint(tmp_path / "m")))
    assert snapshot_format_refusal(spec, "sharded_state") is None


def test_launch_dry_run_json_for_sglang_without_sglang_installed(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    result = run_cli("launch", "--dry-run", "--json", "--artifact-path", str(tmp_path / "store"), "--",
                     "sglang", "serve", str(model), "--tp", "2", "--nnodes", "2", "--node-rank", "1",
                     "--dist-init-addr", "head:5000")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("schema", "engine", "engine_version", "model", "served_model_name", "tp", "pp", "dp", "ep",
                "nnodes", "node_rank", "local_ranks", "source_id", "strategy", "reason", "argv", "stage_files"):
        assert key in data, key
    assert data["engine"] == "sglang" and (data["tp"], data["nnodes"], data["node_rank"]) == (2, 2, 1)
    assert [r["tp_rank"] for r in data["local_ranks"]] == [1]
    # `sglang` is not on this PATH (SGLang lives in a venv of its own): a login node's dry run still plans
    assert data["engine_version"] is None and data["strategy"] == "default"
    assert data["engine_problem"] == "engine command 'sglang' not found on PATH" and data["engine_problem"] in data["reason"]


def test_vllm_refuses_stock_snapshot_formats(tmp_path: Path) -> None:
    import sys

    model = checkpoint(tmp_path / "m")
    result = run_cli("launch", "--dry-run", "--snapshot-format", "sharded_state", "--",
                     sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model))
    assert result.returncode == 2 and "SGLang commands only" in result.stderr, result.stderr


def test_presharded_workers_all_read_the_one_shared_dump(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    result = run_cli("launch", "--dry-run", "--json", "--snapshot-format", "presharded", "--artifact-path",
                     str(tmp_path / "store"), "--", "sglang", "serve", str(model), "--tp-size", "2")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["snapshot_format"] == "sglang-presharded"
    assert [(r["tp_rank"], r["snapshot_rank"]) for r in data["local_ranks"]] == [(0, 0), (1, 0)]


def test_snapshot_file_paths_keep_their_folder_inside_the_rank() -> None:
    from mxlaunch.launch.decide import _rank_rel

    assert _rank_rel(Path("/s/id/data-x/ranks/3/part-00000.safetensors")) == (3, "part-00000.safetensors")
    assert _rank_rel(Path("/s/ranks/x/data/ranks/0/TP-1-sig-ab/checksum.json")) == (0, "TP-1-sig-ab/checksum.json")


def test_explicit_fields_see_abbreviations_aliases_and_config(tmp_path: Path) -> None:
    from mxlaunch.engines.sglang_argv import explicit_fields

    cfg = tmp_path / "c.yaml"
    cfg.write_text("node-rank: 1\n")
    got = explicit_fields([*SERVER, "--model-path", "m", "--nnod", "2", "--nccl-init-addr=h:1", "--config", str(cfg)])
    assert got == {"model_path": "m", "nnodes": 2, "dist_init_addr": "h:1", "node_rank": 1}
    assert "nnodes" not in explicit_fields([*SERVER, "--model-path", "m"])  # a default is not explicit
