"""The launch pipeline: argv → spec → identity → plan → (stage ∥ engine) → hand-off → cleanup.

    decide.py   the plan: strategy, command, files and why (no side effects; the dry run prints it)
    run.py      carrying it out: run folder, plan file, staging ∥ engine, markers, publish, readiness
    process.py  the engine process and its output (shared with `profile -- CMD`)
    engine_start.py  the engine's own start-up: its start method (spawn, or a fork from warmstart/'s zygote)
    capture.py (+ capture_part.py who writes what, capture_upload.py from /dev/shm), capture_route.py,
    kernel.py, p2p.py, shutdown.py  a capture, JIT caches, P2P, stopping
    model_fetch.py  the command's remote model, fetched before the plan (remote/ gets a request, not argv)
    cleanup.py  /dev/shm: this run's folder, stale runs, segments a dead engine left
Launcher side: it may use engines/, store/, coord/, staging/, kernelcache/, warmstart/ (zygotes, engine
snapshots); never plugin/ or transfer/ (they run
inside the engine) and never cli/. Callers import the module that defines the name: this file re-exports
nothing (a re-export here would make every submodule that imports a sibling a circle through it).
"""
