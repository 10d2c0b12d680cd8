"""What the plan says about a quantized model: which method, where it was named, and how a snapshot restores it.

Why: a quantized checkpoint takes one of three paths through mxlaunch (docs/quantized.md) — the raw tensors before
the engine's post-processing (pre-quantized checkpoints), a processed layout built on placeholders first (vLLM's
online fp8), or the engine's own loader (what a snapshot cannot restore) — and a user sizing a job should read which
one before it runs (`launch --dry-run`, its `--json` "quantization"), not find out from a fallback line afterwards.
Each engine knows its refusals and its processed methods (engines/vllm_quantization.py, sglang_quantization.py);
this module only puts their answer in one shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import model_config

RAW, PROCESSED, DEFAULT = "raw", "processed", "default"


def _hf_quant_config(spec: LaunchSpec) -> bool:
    """ModelOpt's older exports keep their config in hf_quant_config.json beside config.json, not in it."""
    return bool(spec.model_path) and (Path(spec.model_path) / "hf_quant_config.json").is_file()


def checkpoint_quantized(spec: LaunchSpec) -> bool:
    """Is the checkpoint itself quantized? SGLang's own test (ModelConfig._is_already_quantized): a quantization or
    compression config in config.json, or hf_quant_config.json beside it."""
    config = model_config(spec.model_path)
    return bool(config.get("quantization_config") or config.get("compression_config")) or _hf_quant_config(spec)


def stored_method(spec: LaunchSpec) -> str:
    """The checkpoint's own quantization ("awq", "compressed-tensors", "modelopt/FP8", ...), or ""."""
    config = model_config(spec.model_path)
    qcfg = config.get("quantization_config") or config.get("compression_config") or {}
    if not isinstance(qcfg, dict):
        return ""
    method = str(qcfg.get("quant_method") or qcfg.get("format") or "").lower()
    algo = qcfg.get("quant_algo")
    if not method and _hf_quant_config(spec):
        method = "modelopt"
    return f"{method}/{algo}" if method and algo else method


def summary(spec: LaunchSpec, refusal: Optional[str], processed_note: Optional[str], raw_note: str) -> Optional[Dict]:
    """The plan's "quantization" entry, or None for a model served unquantized.

    refusal: the engine's reason a snapshot cannot restore it; processed_note: why it is restored through a
    processed layout (None: it is not); raw_note: what the raw snapshot holds for this engine."""
    stored = stored_method(spec)
    flag = (spec.quantization or "").lower()
    if not stored and not flag:
        return None
    if refusal:
        restore, reason = DEFAULT, refusal
    elif processed_note:
        restore, reason = PROCESSED, processed_note
    else:
        restore, reason = RAW, raw_note
    return {"method": stored or flag, "named_by": "checkpoint" if stored else "--quantization",
            "restore": restore, "reason": reason}
