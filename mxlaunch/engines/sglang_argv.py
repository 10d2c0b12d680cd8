"""SGLang launch commands: argv → LaunchSpec, and the command for a plan.

Forms: `python -m sglang.launch_server FLAGS` and `sglang serve [MODEL] [--model-type T] FLAGS`.
SGLang parses with argparse (abbreviations allowed) after merging `--config FILE.yaml` in front of the
command line (its `ConfigArgumentMerger`: config < command line). This module reproduces that on
SGLang's own option table (engines/sglang_flags.py, generated from SGLang's parser), so a login node
without SGLang parses exactly what SGLang would: `--tp 2` is `--tp-size 2` (a unique prefix), while
`--pp 2` is refused as SGLang refuses it (ambiguous in 0.5.23).
Where SGLang puts workers, and the engine as the launcher sees it: engines/sglang_engine.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from mxlaunch.engines import argmirror as A
from mxlaunch.engines.argmirror import Opt as _Opt
from mxlaunch.engines.argmirror import Token
from mxlaunch.engines.base import LaunchSpec, splice_argv
from mxlaunch.engines.environment import engine_python, installed_version, resolve_model_path
from mxlaunch.engines.sglang_flags import CONFIG_UNSUPPORTED, OPTIONS, SGLANG_VERSION
from mxlaunch.errors import UsageError

ENGINE = "sglang"
DEFAULT_PORT = 30000
DEFAULT_HOST = "127.0.0.1"
SERVER_MODULE = "sglang.launch_server"
SAFE_LOAD_FORMATS = A.SAFE_LOAD_FORMATS

# The fields mxlaunch reads: dest → (option strings as SGLang 0.5.23 spells them, default, kind).
# kind: "int1" (an int ≥ 1), "int0" (≥ 0), "str", "bool" (store_true), "list" (nargs *).
FIELDS: Dict[str, Tuple[Tuple[str, ...], Any, str]] = {
    "model_path": (("--model-path", "--model"), None, "str"),
    "tp_size": (("--tp-size", "--tensor-parallel-size"), 1, "int1"),
    "pp_size": (("--pp-size", "--pipeline-parallel-size"), 1, "int1"),
    "dp_size": (("--dp-size", "--data-parallel-size"), 1, "int1"),
    "attn_dp_size": (("--attn-dp-size", "--attention-data-parallel-size"), 1, "int1"),
    "attn_cp_size": (("--attn-cp-size", "--attention-context-parallel-size"), 1, "int1"),
    "moe_dp_size": (("--moe-dp-size", "--moe-data-parallel-size"), 1, "int1"),
    "dcp_size": (("--dcp-size", "--decode-context-parallel-size"), 1, "int1"),
    "ep_size": (("--ep-size", "--expert-parallel-size", "--ep"), 1, "int1"),
    "ep_num_redundant_experts": (("--ep-num-redundant-experts",), 0, "int0"),
    "init_expert_location": (("--init-expert-location",), "trivial", "str"),
    "nnodes": (("--nnodes",), 1, "int1"),
    "node_rank": (("--node-rank",), 0, "int0"),
    "dist_init_addr": (("--dist-init-addr", "--nccl-init-addr"), None, "str"),
    "dtype": (("--dtype",), "auto", "str"),
    "quantization": (("--quantization",), None, "str"),
    "modelopt_quant": (("--modelopt-quant",), None, "str"),
    "moe_runner_backend": (("--moe-runner-backend",), "auto", "str"),
    "load_format": (("--load-format",), "auto", "str"),
    "model_loader_extra_config": (("--model-loader-extra-config",), "{}", "str"),
    "json_model_override_args": (("--json-model-override-args",), "{}", "str"),
    "model_impl": (("--model-impl",), "auto", "str"),
    "revision": (("--revision",), None, "str"),
    "served_model_name": (("--served-model-name",), None, "str"),
    "host": (("--host",), DEFAULT_HOST, "str"),
    "port": (("--port",), DEFAULT_PORT, "int0"),
    "device": (("--device",), None, "str"),
    "enable_dp_attention": (("--enable-dp-attention",), False, "bool"),
    "enable_lora": (("--enable-lora",), None, "bool"),
    "lora_paths": (("--lora-paths",), None, "list"),
    "speculative_algorithm": (("--speculative-algorithm",), None, "str"),
    "speculative_draft_model_path": (("--speculative-draft-model-path", "--speculative-draft-model"), None, "str"),
    "use_ray": (("--use-ray",), False, "bool"),
    "startup_weight_load_mode": (("--startup-weight-load-mode",), "serial", "str"),
}
_DEST_OF = {opt: dest for dest, (opts, _, _) in FIELDS.items() for opt in opts}
# Settings that change the per-rank tensors beyond tp/pp/ep/dtype/quantization: in the source id when set.
_LAYOUT_DESTS = ("attn_dp_size", "attn_cp_size", "moe_dp_size", "dcp_size", "ep_num_redundant_experts",
                 "init_expert_location", "json_model_override_args", "model_impl", "moe_runner_backend")


# ---- forms ------------------------------------------------------------------------------------------


_FORMS = (A.Form("sglang serve", console="sglang", sub="serve"),
          A.Form(f"python -m {SERVER_MODULE}", module=SERVER_MODULE))


def _split_command(argv: List[str]) -> Tuple[str, int]:
    """(launch form, index of the first SGLang argument)."""
    if not argv:
        raise UsageError("empty command", "give the engine's launch command after --, e.g. python -m sglang.launch_server ...")
    found = A.match_form(argv, _FORMS)
    if found is not None:
        return found[0].label, found[1]
    if os.path.basename(argv[0]) == "sglang":
        sub = argv[1] if len(argv) > 1 else "(nothing)"
        raise UsageError(f"sglang {sub}: only `sglang serve` launches a server", "use sglang serve --model-path MODEL ...")
    if A.PYTHON_EXE.match(os.path.basename(argv[0])):
        raise UsageError("not an SGLang launch command", f"use python -m {SERVER_MODULE} --model-path MODEL ...")
    raise UsageError(f"{argv[0]}: not an SGLang launch command", f"use python -m {SERVER_MODULE} or sglang serve")


def is_sglang_command(argv: List[str]) -> bool:
    """True for `python -m sglang.launch_server ...` and `sglang serve ...`."""
    return A.match_form([str(a) for a in argv], _FORMS) is not None


# ---- argparse, reproduced on SGLang's option table --------------------------------------------------


def _resolve(name: str) -> str:
    """An option string as argparse resolves it: exact, else a unique prefix of a long option."""
    if name in OPTIONS:
        return name
    if name.startswith("--"):
        hits = sorted(o for o in OPTIONS if o.startswith(name))
        if len(hits) == 1:
            return hits[0]
        if hits:
            shown = ", ".join(hits[:4]) + (" ..." if len(hits) > 4 else "")
            likely = next((h for h in hits if h in _DEST_OF), hits[0])
            raise UsageError(f"SGLang option {name} is ambiguous (could be {shown})",
                             f"spell it out, e.g. {likely}")
    raise UsageError(f"{name} is not an SGLang {SGLANG_VERSION} option", "check the flag's spelling (sglang serve --help)")


def _resolve_token(toks: Sequence[Token], i: int) -> A.Resolved:
    tok = toks[i][0]
    name, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
    option = _resolve(name)
    return A.Resolved(option, name, OPTIONS[option], inline if eq else None)


def _error(kind: str, r: Union[A.Resolved, str]) -> UsageError:
    """SGLang's one-line messages for the shared scanner (argmirror.scan)."""
    if isinstance(r, str):  # a positional
        return UsageError(f"SGLang takes no positional argument {r!r}",
                          "pass the model with --model-path MODEL (or right after `sglang serve`)")
    if kind == "no_value":
        return UsageError(f"{r.written} takes no value (got {r.written + '=' + (r.inline or '')!r})", f"write just {r.written}")
    if kind == "needs_values":
        return UsageError(f"{r.written} needs at least one value", f"write {r.written} VALUE [VALUE ...]")
    return UsageError(f"{r.written} needs a value", f"write {r.written} VALUE")


def _scan(toks: List[Token]) -> List[_Opt]:
    """Tokens (text, argv index) → option occurrences, as argparse would split them."""
    return A.scan(toks, _resolve_token, _error, positionals=False).opts


def _config_tokens(path: str) -> List[str]:
    """SGLang's --config YAML as the flags its ConfigArgumentMerger puts before the command line."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        raise UsageError(f"--config {path}: SGLang reads only YAML config files", "give a .yaml or .yml file")
    data = A.read_yaml_mapping(path, "--config")
    for key in data:
        if str(key).replace("-", "_") in CONFIG_UNSUPPORTED:
            raise UsageError(f"--config {path}: SGLang does not accept {key!r} in a config file",
                             f"pass --{str(key).replace('_', '-')} on the command line instead")

    def boolean(key: str, value: bool) -> List[str]:
        flag = f"--{key}"
        if OPTIONS.get(_resolve_quiet(flag)) == "0":
            return [flag] if value else []
        return [flag, str(value).lower()]

    return A.config_tokens(data, boolean)


def _resolve_quiet(flag: str) -> str:
    try:
        return _resolve(flag)
    except UsageError:
        return flag


def _effective(argv: List[str], start: int, form: str) -> List[_Opt]:
    """The option occurrences SGLang sees: --config's flags first, then the command line's."""
    toks = [(t, k) for k, t in enumerate(argv) if k >= start]
    if form == "sglang serve":
        toks = _serve_tokens(toks)
    k = A.config_index(toks, lambda problem, fix: UsageError(f"--config {problem}", fix))
    if k is not None:
        cfg = [(t, None) for t in _config_tokens(toks[k + 1][0])]
        toks = cfg + toks[:k] + toks[k + 2:]
    return _scan(toks)


def _serve_tokens(toks: List[Tuple[str, Optional[int]]]) -> List[Tuple[str, Optional[int]]]:
    """`sglang serve MODEL ...` → --model-path MODEL; --model-type belongs to `sglang serve` itself."""
    out: List[Tuple[str, Optional[int]]] = []
    i = 0
    while i < len(toks):
        t, k = toks[i]
        if t == "--model-type":
            i += 2
            continue
        if t.startswith("--model-type="):
            i += 1
            continue
        out.append((t, k))
        i += 1
    if out and not out[0][0].startswith("-"):
        out = [("--model-path", None)] + out
    return out


def _values(opts: List[_Opt]) -> Dict[str, Any]:
    """The fields mxlaunch reads, with SGLang's defaults and types (the last occurrence wins)."""
    vals: Dict[str, Any] = {dest: default for dest, (_, default, _) in FIELDS.items()}
    for o in opts:
        dest = _DEST_OF.get(o.flag)
        if dest is None:
            continue
        kind = FIELDS[dest][2]
        if kind == "bool":
            vals[dest] = True
        elif kind == "list":
            vals[dest] = list(o.values)
        elif kind in ("int0", "int1"):
            try:
                n = int(o.values[0])
            except ValueError:
                raise UsageError(f"{o.flag} {o.values[0]!r} is not a whole number", f"write {o.flag} N") from None
            if kind == "int1" and n < 1:
                raise UsageError(f"{o.flag} {n}: must be at least 1", f"write {o.flag} 1 or more")
            if n < 0:
                raise UsageError(f"{o.flag} {n}: must not be negative", f"write {o.flag} 0 or more")
            vals[dest] = n
        else:
            vals[dest] = o.values[0]
    return vals


# ---- parse ------------------------------------------------------------------------------------------


def sglang_version(python: Optional[str] = None) -> Optional[str]:
    """The installed SGLang's version from package metadata (None: not installed there)."""
    return installed_version(("sglang",), python)


def _json_object(flag: str, text: Any) -> Dict[str, Any]:
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text or "{}")
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not valid JSON", f"give a JSON object, e.g. {flag} '{{}}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} {text!r} is not a JSON object", f"give a JSON object, e.g. {flag} '{{}}'")
    return value


def parse_sglang_argv(argv: List[str], *, engine_version: Optional[str] = None) -> LaunchSpec:
    """An SGLang launch command → LaunchSpec (UsageError with one line on bad input)."""
    argv = [str(a) for a in argv]
    form, start = _split_command(argv)
    vals = _values(_effective(argv, start, form))
    model = vals["model_path"]
    if not model:
        raise UsageError(f"{form}: no model", f"give one: {form} --model-path MODEL ...")

    reasons: List[str] = []
    model_path, why = resolve_model_path(model, vals["revision"])
    if why:
        reasons.append(why)
    extra = _json_object("--model-loader-extra-config", vals["model_loader_extra_config"])
    overrides = _json_object("--json-model-override-args", vals["json_model_override_args"])
    lf = vals["load_format"]
    if A.load_format_reason(lf):
        reasons.append(A.load_format_reason(lf))
    if vals["quantization"] == "gguf":
        reasons.append("GGUF checkpoints (--quantization gguf) load through their own loader")
    if vals["modelopt_quant"]:
        reasons.append("--modelopt-quant quantizes while loading (ModelOpt's loader); mxlaunch leaves it alone")
    if vals["enable_lora"] or vals["lora_paths"]:
        reasons.append(A.lora_reason("--enable-lora / --lora-paths"))
    if vals["speculative_algorithm"] or vals["speculative_draft_model_path"]:
        reasons.append(A.speculative_reason("--speculative-algorithm"))
    if vals["startup_weight_load_mode"] != "serial":
        reasons.append(f"--startup-weight-load-mode {vals['startup_weight_load_mode']} loads weights on its own schedule; "
                       "mxlaunch hooks the serial path")
    if vals["use_ray"]:
        reasons.append(A.ray_reason("--use-ray", "schedulers"))
    if vals["device"] not in (None, "cuda", "cpu"):
        reasons.append(f"--device {vals['device']}: mxlaunch restores into cuda and cpu memory only")
    tp, pp, dp = vals["tp_size"], vals["pp_size"], vals["dp_size"]
    nnodes, node_rank = vals["nnodes"], vals["node_rank"]
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} with --nnodes {nnodes}", f"give a node rank below {nnodes}")
    if nnodes > 1 and not vals["dist_init_addr"]:
        raise UsageError(f"--nnodes {nnodes} without --dist-init-addr", "add --dist-init-addr HEAD_HOST:PORT (the same on every node)")
    attn_dp = vals["attn_dp_size"]
    if vals["enable_dp_attention"]:  # SGLang resolves the deprecated spelling to --attn-dp-size <dp-size>
        attn_dp, dp = dp, 1
    layout: Dict[str, Any] = {}
    for dest in _LAYOUT_DESTS:
        value = attn_dp if dest == "attn_dp_size" else vals[dest]
        if dest == "json_model_override_args":
            value = overrides or None
        if value not in (None, FIELDS[dest][1]):
            layout[dest] = value
    ep = vals["ep_size"]
    return LaunchSpec(
        engine=ENGINE,
        engine_version=engine_version if engine_version is not None else sglang_version(engine_python(argv)),
        launch_form=form,
        model=model,
        model_path=model_path,
        served_model_name=vals["served_model_name"] or model,
        argv=list(argv),
        tp=tp,
        pp=pp,
        dp=dp,
        expert_parallel=ep > 1,
        ep=ep,
        nnodes=nnodes,
        node_rank=node_rank,
        dtype=vals["dtype"],
        quantization=vals["quantization"],
        load_format=lf,
        model_loader_extra_config=extra or None,
        host=vals["host"],
        port=vals["port"],
        device=vals["device"],
        revision=vals["revision"],
        layout_extras=layout,
        unsafe_reasons=reasons,
    )


def explicit_fields(argv: List[str]) -> Dict[str, Any]:
    """dest → value for the fields mxlaunch reads that the command sets itself — on its command line
    (any alias or abbreviation) or in its --config file — so that Slurm defaults never override them."""
    argv = [str(a) for a in argv]
    form, start = _split_command(argv)
    opts = _effective(argv, start, form)
    return A.explicit(opts, lambda o: _DEST_OF.get(o.flag), _values(opts))


# Flags that change what SGLang compiles or captures (torch.compile, CUDA graphs, kernels): the kernel
# cache key digests their values as written (mxlaunch/kernelcache/caches.py).
COMPILE_FLAGS = ("--dtype", "--quantization", "--kv-cache-dtype", "--tp-size", "--pp-size", "--dp-size", "--ep-size",
                 "--disable-cuda-graph", "--cuda-graph-max-bs", "--cuda-graph-bs", "--enable-torch-compile",
                 "--torch-compile-max-bs", "--attention-backend", "--max-running-requests", "--chunked-prefill-size",
                 "--enable-dp-attention", "--moe-runner-backend", "--context-length", "--max-prefill-tokens")


def compile_flags(argv: List[str]) -> Dict[str, Any]:
    """COMPILE_FLAGS the command sets (any alias, or its --config file), canonical name → values as written."""
    argv = [str(a) for a in argv]
    form, start = _split_command(argv)
    return A.flag_values(_effective(argv, start, form), COMPILE_FLAGS)


# ---- rewrite ----------------------------------------------------------------------------------------


def rewrite_sglang_argv(spec: LaunchSpec, *, set_flags: Dict[str, Optional[str]]) -> List[str]:
    """spec.argv with each option in `set_flags` set: every existing occurrence (`--x v` or `--x=v`, any
    alias or abbreviation) is replaced in place by `--x value` (value None: the flag alone), or appended.
    Options from a --config file are overridden by the appended flag (the command line wins there).
    Everything else stays as it is."""
    argv = list(spec.argv)
    form, start = _split_command(argv)
    opts = _effective(argv, start, form)
    canonical = {opt: _resolve(opt) for opt in set_flags}
    drop: Dict[int, str] = {}
    for o in opts:
        for flag, resolved in canonical.items():
            if _DEST_OF.get(o.flag, o.flag) == _DEST_OF.get(resolved, resolved):
                for k in o.origin:
                    if k is not None:
                        drop[k] = flag
    replace = {flag: [flag] if value is None else [flag, value] for flag, value in set_flags.items()}
    return splice_argv(argv, drop, replace)
