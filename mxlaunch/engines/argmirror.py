"""argparse, mirrored: what both engines' argv parsers share (engines/vllm_argv.py, engines/sglang_argv.py).

mxlaunch reads engine command lines without importing the engine (a login node has none), so each
engine carries its parser's option table, generated from the engine's own parser (scripts/kits/gen_*_flags.py,
drift-checked by the oracle tests), and this module splits tokens the way argparse does over such a
table: launch forms (`python -m MODULE` and console scripts), flags and their values by arity, the
`--config FILE.yaml` mapping turned into flags, and which fields a command sets itself. What differs
between the engines — vLLM's dotted JSON flags and lenient unknown flags, SGLang's prefix abbreviations
— is the engine's `resolve` function; the messages stay each engine's own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from mxlaunch.engines.environment import PYTHON_EXE
from mxlaunch.errors import UsageError

Token = Tuple[str, Optional[int]]  # text, argv index (None: it came from a --config file)
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def is_flag(tok: str) -> bool:
    """argparse's test: '-x…' is a flag unless it is '-', a negative number or contains a space."""
    return tok.startswith("-") and tok != "-" and not NEGATIVE_NUMBER.match(tok) and " " not in tok


# ---- launch forms ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    """One way to launch a server: a console script (`vllm serve`) or `python -m MODULE [SUB]`."""

    label: str
    console: Optional[str] = None
    module: Optional[str] = None
    sub: Optional[str] = None  # a subcommand after the script or module ("serve")
    positional_model: bool = False  # the model may come as the first argument (`vllm serve M`)


def python_module(argv: Sequence[str]) -> Optional[Tuple[str, int]]:
    """(module, index after it) for `python[3[.x]] [interpreter options] -m MODULE ...`, else None."""
    if not argv or not PYTHON_EXE.match(os.path.basename(argv[0])):
        return None
    i = 1
    while i < len(argv) and argv[i] != "-m" and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-X", "-W") else 1  # interpreter options before -m
    if i + 1 < len(argv) and argv[i] == "-m":
        return argv[i + 1], i + 2
    return None


def match_form(argv: Sequence[str], forms: Sequence[Form]) -> Optional[Tuple[Form, int]]:
    """The form argv is and the index of its first engine argument, or None."""
    if not argv:
        return None
    exe = os.path.basename(argv[0])
    mod = python_module(argv)
    for form in forms:
        if form.console is not None and exe == form.console:
            start = 1
        elif form.module is not None and mod is not None and mod[0] == form.module:
            start = mod[1]
        else:
            continue
        if form.sub is None:
            return form, start
        if start < len(argv) and argv[start] == form.sub:
            return form, start + 1
    return None


# ---- --config FILE.yaml ---------------------------------------------------------------------------------


def read_yaml_mapping(path: str, label: str) -> Dict[str, Any]:
    """A YAML config file's top-level mapping ({} for an empty file); one-line errors on anything else."""
    import yaml  # pyyaml, a dependency; imported here to keep the engines' argv modules quick to import

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise UsageError(f"{label} {path}: cannot read it ({e.strerror})", "check the path") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "bad YAML"
        raise UsageError(f"{label} {path}: not valid YAML ({first})", "fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{label} {path}: not a mapping of flag: value", "write one flag per line, e.g. port: 8001")
    return data


def config_tokens(data: Dict[str, Any], boolean: Callable[[str, bool], List[str]]) -> List[str]:
    """A config mapping as command-line flags: lists as `--key a b` (empty: nothing), mappings as JSON,
    booleans as the engine writes them (`boolean(key, value)`), anything else as text."""
    toks: List[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if isinstance(value, bool):
            toks += boolean(str(key), value)
        elif isinstance(value, list):
            toks += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            toks += [flag, json.dumps(value)]
        else:
            toks += [flag, str(value)]
    return toks


def config_index(toks: Sequence[Token], error: Callable[[str, str], UsageError]) -> Optional[int]:
    """Where `--config` stands (None: nowhere); two of them or one without a file is an error."""
    at = [k for k, (t, _) in enumerate(toks) if t == "--config"]
    if len(at) > 1:
        raise error("given more than once", "merge the files into one")
    if at and at[0] + 1 >= len(toks):
        raise error("needs a file", "write --config FILE.yaml")
    return at[0] if at else None


# ---- flags and values -----------------------------------------------------------------------------------


@dataclass
class Opt:
    """One flag occurrence: its canonical name, its values and where its tokens stand in argv."""

    flag: str  # canonical option string
    written: str  # as written (-tp, --tensor_parallel_size, --tp), for messages
    values: List[str]
    origin: List[Optional[int]]  # argv indices of its tokens (None: from the --config file)
    dotted: Optional[List[str]] = None  # vLLM `--flag.a.b value`: the keys after the flag
    append: bool = False  # vLLM dotted `key+`: a list


@dataclass
class Scan:
    opts: List[Opt] = field(default_factory=list)
    positionals: List[Token] = field(default_factory=list)
    guessed: List[str] = field(default_factory=list)  # unknown flags that took the next token as their value


@dataclass
class Resolved:
    """What the engine's table says about one flag token. arity: "0", "1", "?", "*", "+" as argparse's
    nargs, or "1?" (one value when a non-flag token follows, else none: flags the table does not know)."""

    flag: str
    written: str
    arity: str
    inline: Optional[str] = None  # the value after '=' in `--flag=value`
    guessed: bool = False  # unknown flag: report it when it took a value


# The engine's messages: error(kind, resolved) → UsageError; kinds: "no_value" (a value given to a flag
# that takes none), "needs_value", "needs_values" (nargs "+"), "positional" (an engine without positionals).
Errors = Callable[[str, Union[Resolved, str]], UsageError]
Resolver = Callable[[Sequence[Token], int], Union[Resolved, Tuple[Opt, int]]]


def scan(toks: Sequence[Token], resolve: Resolver, error: Errors, *, positionals: bool,
         star_needs_one: bool = False) -> Scan:
    """Tokens → flag occurrences and positionals, as argparse splits them over the engine's table.

    `resolve(toks, i)` reads the flag at toks[i]: a Resolved, or a finished (Opt, next index) for forms
    only that engine has. `positionals`: whether bare tokens are positional arguments (else an error);
    `--` then ends the flags. `star_needs_one`: treat nargs "*" like "+" (vLLM's own parsing of lists)."""
    out = Scan()
    i, n = 0, len(toks)
    while i < n:
        tok, org = toks[i]
        if positionals and tok == "--":  # argparse: everything after is positional
            out.positionals.extend(toks[i + 1:])
            break
        if not is_flag(tok):
            if not positionals:
                raise error("positional", tok)
            out.positionals.append((tok, org))
            i += 1
            continue
        r = resolve(toks, i)
        if isinstance(r, tuple):
            opt, i = r
            out.opts.append(opt)
            continue
        values: List[str] = []
        origin: List[Optional[int]] = [org]
        i += 1
        arity = "+" if star_needs_one and r.arity == "*" else r.arity
        if r.inline is not None:
            if arity == "0":
                raise error("no_value", r)
            values = [r.inline]
        elif arity == "1":
            if i >= n or is_flag(toks[i][0]):
                raise error("needs_value", r)
            values, origin, i = [toks[i][0]], [org, toks[i][1]], i + 1
        elif arity in ("1?", "?"):
            if i < n and not is_flag(toks[i][0]):
                values, origin, i = [toks[i][0]], [org, toks[i][1]], i + 1
                if r.guessed:
                    out.guessed.append(r.flag)
        elif arity in ("*", "+"):
            while i < n and not is_flag(toks[i][0]):
                values.append(toks[i][0])
                origin.append(toks[i][1])
                i += 1
            if arity == "+" and not values:
                raise error("needs_values", r)
        out.opts.append(Opt(r.flag, r.written, values, origin))
    return out


def explicit(opts: Sequence[Opt], dest_of: Callable[[Opt], Optional[str]], values: Dict[str, Any]) -> Dict[str, Any]:
    """field → value for the fields some occurrence sets (command line or config file)."""
    names = {d for d in (dest_of(o) for o in opts) if d is not None}
    return {name: values[name] for name in names}


def flag_values(opts: Sequence[Opt], flags: Sequence[str]) -> Dict[str, Any]:
    """canonical flag (with any dotted keys) → its values as written, for the occurrences of `flags`
    (the last occurrence wins, as argparse; a boolean flag's value is True). The kernel cache digests these."""
    found: Dict[str, Any] = {}
    wanted = set(flags)
    for o in opts:
        if o.flag in wanted:
            name = o.flag + "".join("." + k for k in (o.dotted or []))
            found[name] = list(o.values) if o.values else True
    return dict(sorted(found.items()))


# ---- what mxlaunch cannot serve from a snapshot (the same words for every engine) -------------------------

SAFE_LOAD_FORMATS = ("auto", "safetensors")


def load_format_reason(load_format: str) -> Optional[str]:
    if load_format in SAFE_LOAD_FORMATS:
        return None
    return f"--load-format {load_format} has its own loader; mxlaunch restores only auto/safetensors checkpoints"


def lora_reason(flags: str) -> str:
    return f"LoRA ({flags}): adapters are loaded outside mxlaunch's snapshot"


def speculative_reason(flag: str) -> str:
    return f"speculative decoding ({flag}): a draft model's weights are not in the snapshot"


def ray_reason(flags: str, who: str) -> str:
    return f"Ray ({flags}): {who} start outside mxlaunch's control"
