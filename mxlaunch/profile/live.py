"""`mxlaunch profile -- CMD`: run a command until it is ready, stop it, and profile its output.

The command runs and is read exactly as `mxlaunch launch` runs an engine (launch/process.py), so both
see the same lines from the same engine.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

from mxlaunch.engines.base import PhaseEvent
from mxlaunch.engines.registry import ENGINES, detect
from mxlaunch.engines.runtime import locate
from mxlaunch.errors import UsageError
from mxlaunch.launch import process
from mxlaunch.profile.profiler import RunProfile, StartupProfiler


# ---- live runs -----------------------------------------------------------------------------------


def engine_from_argv(argv: Sequence[str]) -> str:
    """The engine whose launch form argv is; else one whose name the command mentions (a wrapper
    script); else "auto" (detect from the output)."""
    found = detect(argv)
    if found is not None:
        return found.name
    joined = " ".join(argv).lower()
    return next((name for name in ENGINES if name in joined), "auto")


def check_startable(argv: Sequence[str]) -> None:
    """An engine's own launch form that cannot start here: a one-line UsageError before anything is spawned."""
    found = detect(argv)
    if found is not None:
        runtime = locate(argv, display=found.display, dists=found.version_dists)
        if runtime.problem:
            raise UsageError(runtime.problem, fix=runtime.fix)


def run_live(
    argv: Sequence[str],
    timeout: float,
    engine: str = "auto",
    on_event: Optional[Callable[[PhaseEvent, float], None]] = None,
    grace: Tuple[float, float] = (15.0, 10.0),
) -> Tuple[RunProfile, Optional[int]]:
    """Run the command until ready (or exit, or timeout), stop it, and profile its output.

    Returns the profile and the command's exit code if it exited on its own before ready.
    """
    if not argv:
        raise UsageError("no command to run", fix="mxlaunch profile -- python -m vllm.entrypoints.openai.api_server ...")
    if engine == "auto":
        engine = engine_from_argv(argv)
    check_startable(argv)
    prof = StartupProfiler(engine=engine, source=" ".join(argv), live=True)
    start = time.monotonic()
    try:
        proc = process.start(argv, stdin=subprocess.DEVNULL, die_with_parent=False)
    except (FileNotFoundError, PermissionError) as exc:
        raise UsageError(f"cannot run {argv[0]}: {exc.strerror or exc}", fix="check the command after --")
    assert proc.stdout is not None
    lines: "queue.Queue[Optional[Tuple[str, float]]]" = queue.Queue()

    def read() -> None:  # the launcher's reader: the same lines as `launch` sees (\n and tqdm's \r)
        try:
            process.read_lines(proc.stdout.fileno(), lambda text, t: lines.put((text, t)), start)
        finally:
            lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    exited_early: Optional[int] = None
    try:
        deadline = start + timeout
        while not prof.done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if item is None:  # output closed: the command (and its children) ended before ready
                exited_early = proc.wait()
                break
            for ev in prof.feed(item[0], item[1]):
                if on_event:
                    on_event(ev, item[1])
    finally:
        process.stop_group(proc, grace)
        reader.join(timeout=5)
        proc.stdout.close()
    if not prof.done:  # the ready time is not extended by lines read after the stop
        prof.last_t = max(prof.last_t or 0.0, min(time.monotonic() - start, timeout))
    return prof.result(), exited_early
