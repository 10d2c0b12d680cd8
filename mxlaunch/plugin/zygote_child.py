"""The forked child's side of the zygote: turn into the requested engine process and run its __main__.

Why a module of its own: what a child must undo of the zygote (its session, descriptors, environment, folder,
signal handlers, random seeds, the zygote's pinned TMPDIR) is one job, and it is what makes a forked engine the
same as a spawned one (`launch/process.start`); the serving loop (plugin/zygote_server.py) only forks and
reaps. Standard library only.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import tempfile
import threading
from typing import Tuple


def _lifeline(fd: int) -> None:
    """Block until the launcher's end closes, then stop this engine's group (the launcher is gone)."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    try:
        os.killpg(os.getpid(), signal.SIGTERM)
    except OSError:
        pass


def _reseed() -> None:
    """A fresh start seeds its generators from the OS; children of one zygote must not share a sequence."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
        except Exception:  # noqa: BLE001
            pass


def become_engine(req: dict, out_fd: int, life_fd: int, entry: Tuple[str, str]) -> int:
    """In the forked child: turn into the requested engine process and run its __main__; its exit code."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    for fd in (null, out_fd):
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # the zygote imported under its own pinned TMPDIR (warmstart/zygote_env.py): use the request's
    os.chdir(req["cwd"])
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(write_through=True)  # type: ignore[attr-defined]
            except (AttributeError, ValueError):
                pass
    _reseed()
    threading.Thread(target=_lifeline, args=(life_fd,), name="mx-lifeline", daemon=True).start()
    sys.argv = list(req["argv"])
    kind, target = entry
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 — printed as the interpreter would, then a failure code
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code
