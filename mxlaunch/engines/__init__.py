"""Engine-specific knowledge outside the engine process: one module per engine.

`LOG_FORMATS` maps an engine name to the class that reads its start-up log lines (one instance
per log: vLLM's year-less timestamps need to remember the month they saw last).
"""

from __future__ import annotations

from typing import Callable, Dict

from mxlaunch.engines.base import LogFormat, LogLine, PhaseEvent
from mxlaunch.engines.sglang import SGLangLog
from mxlaunch.engines.vllm import VLLMLog

LOG_FORMATS: Dict[str, Callable[[], LogFormat]] = {"sglang": SGLangLog, "vllm": VLLMLog}

__all__ = ["LOG_FORMATS", "LogFormat", "LogLine", "PhaseEvent"]
