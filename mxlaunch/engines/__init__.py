"""Engine-specific knowledge outside the engine process: one module per engine.

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
    """"vllm" or "sglang" for a launch command either engine module parses; None otherwise.

    The one place that tells engines apart by their command line (launch and the Slurm helpers ask it)."""
    from mxlaunch.engines.vllm import is_vllm_command

    if is_vllm_command(argv):
        return "vllm"
    from mxlaunch.engines.sglang_argv import is_sglang_command

    if is_sglang_command(argv):
        return "sglang"
    return None


__all__ = ["LOG_FORMATS", "LogFormat", "LogLine", "PhaseEvent", "detect_engine"]
