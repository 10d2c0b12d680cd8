"""The engines mxlaunch knows, by name — the one place that lists them (like vLLM's
`_LOAD_FORMAT_TO_MODEL_LOADER`). Launch, Slurm, profile and the CLI ask here and never name an engine.

Adding an engine: implement engines/protocol.py's `Engine` in one module and add it below
(docs/engines.md walks through it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.protocol import Engine
from mxlaunch.engines.runtime import EngineRuntime, locate
from mxlaunch.engines.sglang_engine import ENGINE as SGLANG
from mxlaunch.engines.vllm_engine import ENGINE as VLLM
from mxlaunch.errors import UsageError

ENGINES: Dict[str, Engine] = {VLLM.name: VLLM, SGLANG.name: SGLANG}


def detect(argv: Sequence[str]) -> Optional[Engine]:
    """The engine whose launch forms argv is, or None."""
    argv = [str(a) for a in argv]
    return next((engine for engine in ENGINES.values() if engine.matches(argv)), None)


def detect_engine(argv: Sequence[str]) -> Optional[str]:
    """The registry name of the engine that runs argv, None when none does."""
    engine = detect(argv)
    return engine.name if engine is not None else None


def engine_for(argv: Sequence[str]) -> Engine:
    """detect(), or a one-line UsageError listing every form mxlaunch understands."""
    if not argv:
        raise UsageError("no engine command given", "put the engine's command after --, e.g. mxlaunch launch -- vllm serve M")
    engine = detect(argv)
    if engine is None:
        forms = ", ".join(e.command_forms for e in ENGINES.values())
        raise UsageError(f"cannot tell which engine runs {' '.join(str(a) for a in argv[:3])!r}", f"use {forms}")
    return engine


def inspect_command(argv: Sequence[str]) -> Tuple[LaunchSpec, EngineRuntime]:
    """argv → (LaunchSpec, what would run it): the version is the one installed where the engine runs
    (None, with the runtime's `problem`, when the command cannot start there)."""
    engine = engine_for(argv)
    runtime = locate(argv, display=engine.display, dists=engine.version_dists)
    spec = engine.parse(argv, engine_version=runtime.version)
    if runtime.version is None:  # parse() reads the launcher's own when given none: not where the engine runs
        spec = replace(spec, engine_version=None)
    return spec, runtime


def parse_command(argv: Sequence[str]) -> LaunchSpec:
    """argv → LaunchSpec by the engine that runs it, with the version installed in the engine's Python."""
    return inspect_command(argv)[0]


def all_snapshot_formats() -> set:
    """Every engine's stock --snapshot-format choices (besides raw)."""
    return {f for e in ENGINES.values() for f in e.snapshot_formats}


def spec_engine(spec: LaunchSpec) -> Engine:
    return ENGINES[spec.engine]
