"""The vLLM settings mxlaunch reads from a command line: each flag's field, conversion and default, and
the values a scanned command gives them (engines/vllm_argv.py scans; this module reads values).

Conversions are vLLM's own (argparse types in vllm/engine/arg_utils.py), so a value vLLM would refuse is
refused here with a one-line message naming a good value.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, Optional, Tuple

from mxlaunch.engines.argmirror import Scan

DEFAULT_PORT = 8000
DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")

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


READ: Dict[str, Tuple[str, Callable[[str], Any], str]] = {
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
READ_BOOL = {
    "--enable-expert-parallel": ("expert_parallel", True),
    "--no-enable-expert-parallel": ("expert_parallel", False),
    "--enable-lora": ("enable_lora", True),
    "--no-enable-lora": ("enable_lora", False),
    "--headless": ("headless", True),
    "--worker-use-ray": ("worker_use_ray", True),
    "--engine-use-ray": ("worker_use_ray", True),
}
DEFAULTS: Dict[str, Any] = {
    "model": None, "served_model_name": None, "tp": 1, "pp": 1, "dp": 1, "dp_size_local": None,
    "dp_start_rank": None, "nnodes": 1, "node_rank": 0, "pcp": 1, "dtype": "auto", "quantization": None,
    "load_format": "auto", "model_loader_extra_config": None, "host": None, "port": DEFAULT_PORT,
    "revision": None, "hf_overrides": None, "model_impl": "auto", "speculative_config": None,
    "speculative_model": None, "distributed_executor_backend": None, "data_parallel_backend": "mp",
    "lora_modules": None, "config": None, "expert_parallel": False, "enable_lora": None, "headless": False,
    "worker_use_ray": False, "master_addr": None, "master_port": None,
}  # fmt: skip


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


def merge(dst: Dict[str, Any], src: Dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k] = dst[k] + v
        else:
            dst[k] = v


def values_of(scan: Scan, bad: Callable[[str, str, str], Exception]) -> Dict[str, Any]:
    """field → value after vLLM's defaults, the scanned flags (the last one wins) and dotted JSON flags
    (merged per flag; they replace a plain one). `bad(flag, problem, fix)` makes the one-line error."""
    vals = dict(DEFAULTS)
    dotted: Dict[str, Dict[str, Any]] = {}
    for o in scan.opts:
        if o.dotted is not None:
            value: Any = _dotted_value(o.values[0]) if not o.append else o.values[0].split(",")
            for key in reversed(o.dotted):
                value = {key: value}
            merge(dotted.setdefault(o.flag, {}), value)
            continue
        if o.flag in READ_BOOL:
            name, v = READ_BOOL[o.flag]
            vals[name] = v
            continue
        if o.flag not in READ:
            continue
        name, conv, good = READ[o.flag]
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
            raise bad(shown, f"{o.values[0]!r} is {why}", f"give {good}") from None
    for flag, d in dotted.items():  # vLLM appends each merged dotted flag as JSON at the end: it wins
        if flag in READ:
            vals[READ[flag][0]] = d
    return vals
