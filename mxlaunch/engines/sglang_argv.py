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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mxlaunch.engines.base import LaunchSpec, splice_argv
from mxlaunch.engines.environment import PYTHON_EXE, engine_python, installed_version, resolve_model_path
from mxlaunch.engines.sglang_flags import CONFIG_UNSUPPORTED, OPTIONS, SGLANG_VERSION
from mxlaunch.errors import UsageError

ENGINE = "sglang"
DEFAULT_PORT = 30000
DEFAULT_HOST = "127.0.0.1"
SERVER_MODULE = "sglang.launch_server"
SAFE_LOAD_FORMATS = ("auto", "safetensors")

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
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass
class _Opt:
    """One option occurrence: its SGLang option string, its values, and where its tokens sit in argv
    (None for tokens that came from the --config file)."""

    option: str
    values: List[str]
    origin: List[Optional[int]] = field(default_factory=list)


# ---- forms ------------------------------------------------------------------------------------------


def _split_command(argv: List[str]) -> Tuple[str, int]:
    """(launch form, index of the first SGLang argument)."""
    if not argv:
        raise UsageError("empty command", "give the engine's launch command after --, e.g. python -m sglang.launch_server ...")
    exe = os.path.basename(argv[0])
    if exe == "sglang":
        if len(argv) > 1 and argv[1] == "serve":
            return "sglang serve", 2
        sub = argv[1] if len(argv) > 1 else "(nothing)"
        raise UsageError(f"sglang {sub}: only `sglang serve` launches a server", "use sglang serve --model-path MODEL ...")
    if PYTHON_EXE.match(exe):
        i = 1
        while i < len(argv) and argv[i] != "-m" and argv[i].startswith("-"):
            i += 2 if argv[i] in ("-X", "-W") else 1
        if i + 1 < len(argv) and argv[i] == "-m" and argv[i + 1] == SERVER_MODULE:
            return f"python -m {SERVER_MODULE}", i + 2
        raise UsageError("not an SGLang launch command", f"use python -m {SERVER_MODULE} --model-path MODEL ...")
    raise UsageError(f"{argv[0]}: not an SGLang launch command", f"use python -m {SERVER_MODULE} or sglang serve")


def is_sglang_command(argv: List[str]) -> bool:
    """True for `python -m sglang.launch_server ...` and `sglang serve ...`."""
    try:
        _split_command([str(a) for a in argv])
    except UsageError:
        return False
    return True


# ---- argparse, reproduced on SGLang's option table --------------------------------------------------


def _is_flag(tok: str) -> bool:
    return tok.startswith("-") and tok != "-" and not _NEGATIVE_NUMBER.match(tok)


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


def _scan(toks: List[Tuple[str, Optional[int]]]) -> List[_Opt]:
    """Tokens (text, argv index) → option occurrences, as argparse would split them."""
    out: List[_Opt] = []
    i = 0
    while i < len(toks):
        tok, origin = toks[i]
        if not _is_flag(tok):
            raise UsageError(f"SGLang takes no positional argument {tok!r}",
                             "pass the model with --model-path MODEL (or right after `sglang serve`)")
        name, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        option = _resolve(name)
        arity = OPTIONS[option]
        used = [origin]
        values: List[str] = []
        i += 1
        if eq:
            if arity == "0":
                raise UsageError(f"{name} takes no value (got {tok!r})", f"write just {name}")
            values = [inline]
        elif arity == "1":
            if i >= len(toks) or _is_flag(toks[i][0]):
                raise UsageError(f"{name} needs a value", f"write {name} VALUE")
            values = [toks[i][0]]
            used.append(toks[i][1])
            i += 1
        elif arity in ("?", "*", "+"):
            while i < len(toks) and not _is_flag(toks[i][0]):
                values.append(toks[i][0])
                used.append(toks[i][1])
                i += 1
                if arity == "?":
                    break
            if arity == "+" and not values:
                raise UsageError(f"{name} needs at least one value", f"write {name} VALUE [VALUE ...]")
        out.append(_Opt(option, values, used))
    return out


def _config_tokens(path: str) -> List[str]:
    """SGLang's --config YAML as the flags its ConfigArgumentMerger puts before the command line."""
    import yaml

    p = Path(path).expanduser()
    if p.suffix.lower() not in (".yaml", ".yml"):
        raise UsageError(f"--config {path}: SGLang reads only YAML config files", "give a .yaml or .yml file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror})", "check the path") from exc
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})", "fix the file") from exc
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: the top level must be a mapping of option: value", "fix the file")
    toks: List[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if str(key).replace("-", "_") in CONFIG_UNSUPPORTED:
            raise UsageError(f"--config {path}: SGLang does not accept {key!r} in a config file",
                             f"pass --{str(key).replace('_', '-')} on the command line instead")
        if isinstance(value, bool):
            if OPTIONS.get(_resolve_quiet(flag)) == "0":
                toks += [flag] if value else []
            else:
                toks += [flag, str(value).lower()]
        elif isinstance(value, list):
            toks += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            toks += [flag, json.dumps(value)]
        else:
            toks += [flag, str(value)]
    return toks


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
    configs = [k for k, (t, _) in enumerate(toks) if t == "--config"]
    if len(configs) > 1:
        raise UsageError("more than one --config", "SGLang reads one config file; merge them")
    if configs:
        k = configs[0]
        if k + 1 >= len(toks):
            raise UsageError("--config needs a file", "write --config FILE.yaml")
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
        dest = _DEST_OF.get(o.option)
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
                raise UsageError(f"{o.option} {o.values[0]!r} is not a whole number", f"write {o.option} N") from None
            if kind == "int1" and n < 1:
                raise UsageError(f"{o.option} {n}: must be at least 1", f"write {o.option} 1 or more")
            if n < 0:
                raise UsageError(f"{o.option} {n}: must not be negative", f"write {o.option} 0 or more")
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
    if lf not in SAFE_LOAD_FORMATS:
        reasons.append(f"--load-format {lf} has its own loader; mxlaunch restores only auto/safetensors checkpoints")
    if vals["quantization"] == "gguf":
        reasons.append("GGUF checkpoints (--quantization gguf) load through their own loader")
    if vals["modelopt_quant"]:
        reasons.append("--modelopt-quant quantizes while loading (ModelOpt's loader); mxlaunch leaves it alone")
    if vals["enable_lora"] or vals["lora_paths"]:
        reasons.append("LoRA (--enable-lora / --lora-paths): adapters are loaded outside mxlaunch's snapshot")
    if vals["speculative_algorithm"] or vals["speculative_draft_model_path"]:
        reasons.append("speculative decoding (--speculative-algorithm): a draft model's weights are not in the snapshot")
    if vals["startup_weight_load_mode"] != "serial":
        reasons.append(f"--startup-weight-load-mode {vals['startup_weight_load_mode']} loads weights on its own schedule; "
                       "mxlaunch hooks the serial path")
    if vals["use_ray"]:
        reasons.append("Ray (--use-ray): schedulers start outside mxlaunch's control")
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
    vals = _values(opts)
    return {dest: vals[dest] for dest in {_DEST_OF[o.option] for o in opts if o.option in _DEST_OF}}


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
            if _DEST_OF.get(o.option, o.option) == _DEST_OF.get(resolved, resolved):
                for k in o.origin:
                    if k is not None:
                        drop[k] = flag
    replace = {flag: [flag] if value is None else [flag, value] for flag, value in set_flags.items()}
    return splice_argv(argv, drop, replace)
