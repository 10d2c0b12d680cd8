"""A warm interpreter for engine restarts: it imports the engine once, then forks one engine per request.

Two Python interpreters importing vLLM are most of a restart once the weights take 0.16 s (issue 24); a child
forked from an interpreter that has done the imports starts where they end. Runs in the engine's own Python:

    python -m mxlaunch.plugin.zygote --socket PATH (--module MOD | --path SCRIPT) [--preload a,b] [--idle-s N]

This module imports and decides whether to serve; the serving loop is plugin/zygote_server.py, the child's
change into the engine plugin/zygote_child.py, standing still for a CRIU dump plugin/zygote_dump.py.

It imports the entry (a module, or what a console script imports), then the preload list, refuses to serve if
that initialised CUDA (a forked child could not use it), and only then publishes its socket (bound under a
temporary name, renamed into place: a socket that exists is one that is ready). One Unix connection per start:

    client → zygote: a 1-byte message carrying two fds [output, lifeline], then one JSON line
                     {"argv": [...], "env": {...}, "cwd": "..."}
    zygote → client: {"pid": N}, and once that child has exited {"exit": code} (a Popen returncode)

The child becomes what `launch/process.start` makes of a spawned engine: its own session, output on fds 1 and
2, stdin /dev/null, the request's environment, folder and argv, the default signal handlers, fresh random
seeds; when the lifeline's other end closes (the launcher died) it sends its group SIGTERM, as
PR_SET_PDEATHSIG does. The zygote is single-threaded (select on the socket and on one pidfd per child), so
forking it is safe, and it exits after --idle-s seconds with no child and no request, or when its socket is
removed or replaced.

With --image-log LOG (the launcher can run CRIU, warmstart/zygote_image.py), the zygote stands still after its
imports, where CRIU can dump it: every descriptor on /dev/null (a log file that grows would fail CRIU's size
check on restore), nothing listening, polling for `<key>.resume`. The launcher claims the dump by renaming
`<key>.dumpable`, dumps (which stops this process) and restores the image; the restored copy reads the
resume file (where to log), reopens its output and publishes its socket. Unclaimed after --image-wait-s, it
takes the marker back and goes on as a plain zygote logging to LOG.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import signal
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from mxlaunch.contract import ZYGOTE_REFUSED
from mxlaunch.plugin.zygote_dump import await_image
from mxlaunch.plugin.zygote_server import Zygote, beside

READY_LINE = "mxlaunch zygote: ready"


def script_imports(path: str) -> List[str]:
    """The modules a console script imports at its top level (`from vllm.entrypoints.cli.main import main`)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    mods: List[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.append(node.module)
        elif isinstance(node, ast.Import):
            mods.extend(alias.name for alias in node.names)
    return mods


def warm(modules: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """Import each module; (imported, failed name → why). A failure is the child's to meet, as it would be."""
    done, failed = [], {}
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:  # noqa: BLE001 — an optional module of the engine (a CPU build's CUDA worker)
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
    return done, failed


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 — a torch without CUDA
        return False


def refusal_reason() -> Optional[str]:
    """Why this interpreter must not fork engines, or None."""
    if cuda_initialised():
        return "importing the engine initialised CUDA: a forked engine could not use it"
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"the imports started {len(others)} thread(s) ({', '.join(others)}): forking beside them is unsafe"
    return None


def refuse(socket_path: str, why: str) -> None:
    """Say why in the log and beside the socket (`<key>.refused`): launches say so and start no other."""
    print(f"mxlaunch zygote: not serving — {why}", flush=True)
    final = beside(socket_path, ZYGOTE_REFUSED)
    tmp = f"{final}.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(why + "\n")
        os.replace(tmp, final)
    except OSError:
        pass


def main(args: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxlaunch.plugin.zygote")
    p.add_argument("--socket", required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--module")
    g.add_argument("--path")
    p.add_argument("--preload", default="")
    p.add_argument("--idle-s", type=float, default=900.0)
    p.add_argument("--image-log", help="stand still for a CRIU dump after the imports; log here if unclaimed")
    p.add_argument("--image-wait-s", type=float, default=300.0)
    ns = p.parse_args(args)
    t0 = time.monotonic()
    entry = ("module", ns.module) if ns.module else ("path", os.path.abspath(ns.path))
    first = [ns.module] if ns.module else script_imports(entry[1])
    done, failed = warm(first + [m for m in ns.preload.split(",") if m])
    why = refusal_reason()
    if why:
        refuse(ns.socket, why)
        return 3
    seconds = time.monotonic() - t0
    restored = await_image(ns.socket, ns.image_log, ns.image_wait_s) if ns.image_log else False
    zygote = Zygote(ns.socket, entry, ns.idle_s)
    signal.signal(signal.SIGTERM, lambda *_: (zygote.close(), os._exit(0)))
    zygote.publish()
    print(f"{READY_LINE} imported={len(done)} failed={json.dumps(failed)} modules={len(sys.modules)} "
          f"seconds={seconds:.2f} pid={os.getpid()} restored={'yes' if restored else 'no'}", flush=True)
    try:
        zygote.serve()
    finally:
        zygote.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
