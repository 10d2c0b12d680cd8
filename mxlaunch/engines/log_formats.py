"""Which class reads which engine's start-up log lines, by engine name: light (no argv module, no engine), so
the profiler and the plugin can use it without importing the registry."""

from __future__ import annotations

from typing import Callable, Dict

from mxlaunch.engines.base import LogFormat
from mxlaunch.engines.sglang import SGLangLog
from mxlaunch.engines.vllm import VLLMLog

# one instance per log: vLLM's year-less timestamps need to remember the month they saw last
LOG_FORMATS: Dict[str, Callable[[], LogFormat]] = {"sglang": SGLangLog, "vllm": VLLMLog}
