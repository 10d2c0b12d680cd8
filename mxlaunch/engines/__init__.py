"""Engine-specific knowledge outside the engine process: one module per engine.

`LOG_FORMATS` maps an engine name to the object that reads its start-up log lines.
"""

from __future__ import annotations

from typing import Dict

from mxlaunch.engines.base import LogFormat, LogLine, PhaseEvent
from mxlaunch.engines.sglang import SGLANG_LOG
from mxlaunch.engines.vllm import VLLM_LOG

LOG_FORMATS: Dict[str, LogFormat] = {"sglang": SGLANG_LOG, "vllm": VLLM_LOG}

__all__ = ["LOG_FORMATS", "LogFormat", "LogLine", "PhaseEvent"]
