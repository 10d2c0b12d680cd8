"""How the engine's own processes start: the launcher's cuts to time to ready past the weights (issue 24).

Two, each in the plan (`engine_start`) with its reason, neither changing what the engine serves:
- `fork`: variables from the engine (`start_env`) — vLLM on CUDA forks its engine core from the API server
  instead of spawning one that imports vLLM again. On by default; `--no-engine-fork` leaves the engine's own.
- `zygote` (opt-in, `--zygote`): a restart is forked from a warm interpreter that has imported the engine
  (warmstart/zygote.py). Opt-in because it leaves a process on the node between runs (until idle).
Pure: the environment is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.registry import spec_engine
from mxlaunch.engines.runtime import EngineRuntime
from mxlaunch.warmstart.zygote import ZygoteEntry, entry_for


@dataclass
class EngineStart:
    env: Dict[str, str] = field(default_factory=dict)  # added to the engine's environment
    fork_reason: str = ""
    zygote: Optional[ZygoteEntry] = None  # None: spawned as given
    zygote_reason: str = ""

    def to_json(self) -> Dict[str, Any]:
        return {"env": dict(self.env), "fork_reason": self.fork_reason,
                "zygote": self.zygote.to_json() if self.zygote else None, "zygote_reason": self.zygote_reason}


def plan_engine_start(spec: LaunchSpec, argv: list[str], device_type: str, environ: Mapping[str, str],
                      runtime: Optional[EngineRuntime], *, fork: bool = True, zygote: bool = False,
                      no_fork_by: str = "--no-engine-fork") -> EngineStart:
    """no_fork_by: the option that turned `fork` off, named in the reason only where it changed something (the
    CPU build spawns whatever is asked: then the engine's own reason is the real one)."""
    engine = spec_engine(spec)
    env, fork_reason = engine.start_env(spec, device_type, environ)
    if not fork and env:
        env, fork_reason = {}, f"the engine's own start method ({no_fork_by})"
    start = EngineStart(env=env, fork_reason=fork_reason)
    if not zygote:
        start.zygote_reason = "not asked (--zygote forks restarts from a warm interpreter)"
        return start
    if runtime is None or runtime.problem:
        start.zygote_reason = "the command cannot start"
        return start
    entry, why = entry_for(argv, runtime.python, runtime.executable, engine.zygote_preload)
    start.zygote, start.zygote_reason = entry, why or "a restart forks from a warm interpreter when one is there"
    return start
