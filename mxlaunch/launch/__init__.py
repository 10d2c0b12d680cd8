"""The launch pipeline: argv → spec → identity → plan → (stage ∥ engine) → hand-off → cleanup.

    decide.py   the plan: strategy, command, files and why (no side effects; the dry run prints it)
    run.py      carrying it out: run folder, plan file, staging ∥ engine, markers, publish, readiness
    process.py  the engine process and its output (shared with `profile -- CMD`)
    engine_start.py, zygote.py  the engine's own start-up: its start method, restarts from a warm interpreter
    capture.py, capture_route.py, kernel.py, p2p.py, shutdown.py  a capture, JIT caches, P2P, stopping
    cleanup.py  /dev/shm: this run's folder, stale runs, segments a dead engine left
Launcher side: it may use engines/, store/, coord/, staging/, kernelcache/; never plugin/ or transfer/ (they run
inside the engine) and never cli/.
"""

from mxlaunch.launch.cleanup import SHM_ROOT, remove_orphaned_engine_shm, remove_stale_runs, shm_user_root
from mxlaunch.launch.decide import (STRATEGIES, _rank_rel, LaunchOptions, LaunchPlan, device_type_for, make_plan, parse_command,
                                    plugin_reachable, snapshot_format_name)
from mxlaunch.launch.process import default_log_root
from mxlaunch.launch.run import Launcher, serves_http

__all__ = ["_rank_rel", "SHM_ROOT", "STRATEGIES", "LaunchOptions", "LaunchPlan", "Launcher", "default_log_root", "device_type_for",
           "make_plan", "parse_command", "plugin_reachable", "remove_orphaned_engine_shm", "remove_stale_runs",
           "serves_http", "shm_user_root", "snapshot_format_name"]
