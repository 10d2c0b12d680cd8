"""Several "nodes" of one capture as real processes on this host (tests/unit/test_multinode_capture.py).

    python -m tests.helpers.capture_nodes session --store S --model M --node K --nnodes N --capture-id C ...
        one node's CaptureSession (claim or join, write its ranks, publish or wait) on a real store,
        JSON lines on stdout; --mode die: SIGKILLs itself half-way through writing its part
    python -m tests.helpers.capture_nodes launch --store S --model M --node K --nnodes N --capture-id C ...
        one node's real `Launcher` (plan file, markers, cleanup) around the fake engine below
    python -m tests.helpers.capture_nodes engine [--hang] [--parts N] [--port P]
        a stand-in engine: reads MXLAUNCH_PLAN and, like the plugin, writes each capturing worker's
        files into <capture_dir>/<snapshot rank>/ (temp name, then rename) and its captured/loaded
        markers; --hang never does; --port: then answers GET /health with 200 (a single node's
        launcher waits for that before it uploads a capture from /dev/shm)

Run from the repository root (the launcher starts the engine with this module name).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from mxlaunch.plan import load_plan, write_marker

PY = sys.executable


def engine_argv(model: Path, node: int, nnodes: int, tp: int, dp: int = 1) -> list[str]:
    """The `vllm serve` form (worker nodes need it), with the multi-node flags of node `node`."""
    argv = [PY, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "-tp", str(tp)]
    if dp > 1:
        argv += ["-dp", str(dp)]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1"]
        argv += ["--headless"] if node else []
    return argv


def rank_bytes(rank: int, part: int = 0) -> bytes:
    """A rank's part: distinct bytes per rank and part (the store checks sizes and checksums, not tensors)."""
    return bytes([65 + rank + 8 * part]) * (4096 + rank + 1000 * part)


def write_part(out: Path, name: str, data: bytes) -> Path:
    """As the plugin writes a part: a temp name in the same folder, then a rename."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, out / name)
    return out / name


def serve_health(port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _wait_for(path: str | None) -> None:
    while path and not os.path.exists(path):
        time.sleep(0.05)


def session_main(a: argparse.Namespace) -> int:
    from mxlaunch.launch.decide import LaunchOptions, make_plan
    from mxlaunch.launch.capture import CaptureSession
    from mxlaunch.store.core import Store

    store = Store(a.store)
    plan = make_plan(engine_argv(Path(a.model), a.node, a.nnodes, a.tp), LaunchOptions(
        artifact_path=store.root, capture_id=a.capture_id, kernel_cache=False, p2p=False), store)
    say(event="plan", strategy=plan.strategy, reason=plan.reason)
    session = CaptureSession(store, plan, lambda event, **f: say(event=event, **f), timeout_s=a.timeout)
    why = session.start() if plan.strategy == "capture" else plan.reason
    say(event="started", capturing=why is None, holder=session.holder, why=why,
        workers=session.part.workers, capture_id=session.capture_id)
    if why is not None:
        return 0
    _wait_for(a.go)
    capture_dir, capture_ranks = session.plan_fields()
    for worker, rank in sorted(capture_ranks.items()):
        out = Path(capture_dir) / str(rank)
        (out / "part-00000.safetensors").write_bytes(rank_bytes(rank)[: 100 if a.mode == "die" else None])
        if a.mode == "die":  # killed in the middle of writing its part: no marker, no cleanup, nothing
            os.kill(os.getpid(), signal.SIGKILL)
        (out / "meta.json").write_text("{}")
        session.on_captured(int(worker))
    deadline = time.monotonic() + a.timeout + 30
    while session.state in ("capturing", "waiting") and time.monotonic() < deadline:
        session.poll()
        time.sleep(0.1)
    say(event="end", state=session.state)
    session.close()
    return 0


def launch_main(a: argparse.Namespace) -> int:
    from mxlaunch.launch.decide import LaunchOptions, make_plan
    from mxlaunch.launch.run import Launcher
    from mxlaunch.launch import cleanup
    from mxlaunch.store.core import Store

    cleanup.SHM_ROOT = Path(a.shm)  # this test's own /dev/shm stand-in
    store = Store(a.store)
    opts = LaunchOptions(artifact_path=store.root, capture_id=a.capture_id, kernel_cache=False, p2p=False,
                         capture_only=a.capture_only, run_dir=Path(a.shm) / f"log-{a.node}-{os.getpid()}",
                         ready_timeout=600)
    plan = make_plan(engine_argv(Path(a.model), a.node, a.nnodes, a.tp, a.dp), opts, store)
    plan.argv = [PY, "-m", "tests.helpers.capture_nodes", "engine", *(["--hang"] if a.mode == "hang" else [])]
    runner = Launcher(plan, opts, emit=lambda event, **f: say(event=event, **f), echo=lambda line: None, store=store)
    return runner.run()


def engine_main(a: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    plan = load_plan()
    assert plan is not None
    print("fake engine: loading", flush=True)
    if not a.hang:
        for worker in sorted({int(w) for w in plan.capture_ranks} or {0}):
            target = plan.capture_target(worker)
            if plan.strategy == "capture" and plan.capture_dir and target is not None:
                out = Path(plan.capture_dir) / str(target)
                files = [write_part(out, f"part-{i:05d}.safetensors", rank_bytes(target, i)) for i in range(a.parts)]
                print(f"fake engine: rank {worker} captured into {out}", flush=True)
                write_marker(plan, "captured", worker, {"bytes": sum(f.stat().st_size for f in files),
                                                        "files": [{"name": f.name, "path": str(f)} for f in files]})
            write_marker(plan, "loaded", worker, {"bytes": 0, "seconds": 0.0, "strategy": plan.strategy})
        if a.port:
            serve_health(a.port)
    while True:
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("session", "launch"):
        p = sub.add_parser(name)
        p.add_argument("--store", required=True)
        p.add_argument("--model", required=True)
        p.add_argument("--node", type=int, default=0)
        p.add_argument("--nnodes", type=int, default=2)
        p.add_argument("--tp", type=int, default=2)
        p.add_argument("--dp", type=int, default=1)
        p.add_argument("--capture-id")
        p.add_argument("--mode", default="ok", choices=["ok", "die", "hang"])
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--go")
        p.add_argument("--shm", default="/dev/shm")
        p.add_argument("--capture-only", action="store_true")
    e = sub.add_parser("engine")
    e.add_argument("--hang", action="store_true")
    e.add_argument("--parts", type=int, default=1)
    e.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    return {"session": session_main, "launch": launch_main, "engine": engine_main}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
