"""Engine-specific knowledge outside the engine process. The registry of engines is engines/registry.py
(`ENGINES`, `detect`); this package's import stays light (log formats only), so the plugin can use it.

`LOG_FORMATS` maps an engine name to the class that reads its start-up log lines (one instance
per log: vLLM's year-less timestamps need to remember the month they saw last).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from mxlaunch.engines.base import LogFormat, LogLine, PhaseEvent
from mxlaunch.engines.sglang import SGLangLog
from mxlaunch.engines.vllm import VLLMLog

LOG_FORMATS: Dict[str, Callable[[], LogFormat]] = {"sglang": SGLangLog, "vllm": VLLMLog}


def detect_engine(argv: List[str]) -> Optional[str]:
    """The registry name of the engine that runs argv (engines/registry.py), None when none does."""
    from mxlaunch.engines.registry import detect  # the registry imports the argv modules: only when asked

    engine = detect(argv)
    return engine.name if engine is not None else None


__all__ = ["LOG_FORMATS", "LogFormat", "LogLine", "PhaseEvent", "detect_engine"]
