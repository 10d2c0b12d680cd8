"""A warm interpreter for engine restarts: it imports the engine once, then forks one engine per request.

Two Python interpreters importing vLLM are most of a restart once the weights take 0.16 s (issue 24); a child
forked from an interpreter that has done the imports starts where they end. Runs in the engine's own Python:

    python -m mxlaunch.plugin.zygote --socket PATH (--module MOD | --path SCRIPT) [--preload a,b] [--idle-s N]

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

With --image-log LOG (the launcher can run CRIU, launch/zygote_image.py), the zygote stands still after its
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
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from mxlaunch.contract import ZYGOTE_DUMPABLE, ZYGOTE_INFO, ZYGOTE_REFUSED, ZYGOTE_RESUME, ZYGOTE_SOCKET
from mxlaunch.transfer.ipc_handoff import peer_cred

READY_LINE = "mxlaunch zygote: ready"


def beside(socket_path: str, suffix: str) -> str:
    """The key's other file next to its socket: `<key>.json` (who serves), `<key>.refused` (why not)."""
    return socket_path.removesuffix(ZYGOTE_SOCKET) + suffix


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


def device_files() -> List[str]:
    """The GPU device files this process holds open (/dev/nvidia*): CRIU cannot dump a process holding them."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            held.add(target)
    return sorted(held)


def release_nvml() -> None:
    """NVML left initialised by the imports holds /dev/nvidiactl, /dev/nvidia0 and the caps files open (vLLM
    0.26's platform detection calls nvmlInit while it is imported: scripts/probes/probe_cuda_init.py on the H200).
    Shut it down before a dump: whoever uses it next initialises it again. Only when the library is already
    loaded: never load it for this."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            if "libnvidia-ml" not in f.read():
                return
        import ctypes  # noqa: PLC0415

        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return
    for _ in range(64):  # nvmlInit counts; NVML_SUCCESS (0) until the count reaches zero
        if lib.nvmlShutdown() != 0:
            return


def undumpable_reason() -> Optional[str]:
    """Why CRIU could not dump this interpreter (after releasing NVML), or None."""
    release_nvml()
    held = device_files()
    if held:
        return f"the imports left GPU device files open ({', '.join(held)}), which CRIU cannot dump"
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
    tempfile.tempdir = None  # the zygote imported under its own pinned TMPDIR (launch/zygote_env.py): use the request's
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


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _log_to(*paths: str) -> None:
    """Output onto the first of `paths` that opens (else it stays on /dev/null: a zygote without a log serves)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # never through a link
            break
        except OSError:
            continue
    else:
        return
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def await_image(socket_path: str, log_path: str, wait_s: float) -> bool:
    """Stand still for CRIU until a resume file says go on (output reopened where it says; True when this is
    a restored copy) or unclaimed after wait_s (False: output back on log_path). Runs before the socket
    exists, single-threaded."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    dumpable, resume = beside(socket_path, ZYGOTE_DUMPABLE), beside(socket_path, ZYGOTE_RESUME)
    why = undumpable_reason()
    if why:  # the launcher reads it from the marker and says so; this zygote serves without an image
        _write_atomic(dumpable, json.dumps({"pid": os.getpid(), "undumpable": why}))
        _log_to(log_path)
        print(f"mxlaunch zygote: no image — {why}", flush=True)
        return False
    _write_atomic(dumpable, json.dumps({"pid": os.getpid()}))
    deadline = time.monotonic() + wait_s
    while True:
        # A restored copy finds the resume file at once (written before the restore); the clock may have
        # jumped (another node, another boot), so the file is looked at before the deadline.
        try:
            with open(resume, encoding="utf-8") as f:
                req = json.load(f)
        except (OSError, ValueError):
            req = None
        if req is not None:
            for path in (resume, dumpable):  # dumpable is still there when the launcher went away unclaimed
                try:
                    os.unlink(path)
                except OSError:
                    pass
            _log_to(*[p for p in (req.get("log"), log_path) if p])
            _reseed()
            return bool(req.get("restored"))
        if time.monotonic() > deadline:
            try:
                os.unlink(dumpable)  # unclaimed: nobody will dump us
            except FileNotFoundError:
                deadline = time.monotonic() + wait_s  # claimed: a dump (or its failure's resume file) is coming
            else:
                _log_to(log_path)
                return False
        time.sleep(0.005)


class Zygote:
    """The serving loop: one fork per request, one pidfd per live child, exit when idle or unlinked."""

    def __init__(self, socket_path: str, entry: Tuple[str, str], idle_s: float) -> None:
        self.path = socket_path
        self.entry = entry
        self.idle_s = idle_s
        self.children: Dict[int, Tuple[int, socket.socket]] = {}  # pidfd → (pid, the client's connection)
        self.listener: Optional[socket.socket] = None
        self.inode: Optional[int] = None

    def publish(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(tmp)
        finally:
            os.umask(old)
        sock.listen(16)
        info = {"pid": os.getpid(), "python": sys.executable, "entry": list(self.entry), "started": time.time(),
                "idle_s": self.idle_s, "modules": len(sys.modules)}
        with open(f"{tmp}.json", "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(f"{tmp}.json", self.info_path)
        os.replace(tmp, self.path)
        self.inode = os.stat(self.path).st_ino
        self.listener = sock

    @property
    def info_path(self) -> str:
        return beside(self.path, ZYGOTE_INFO)

    def still_ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def serve(self) -> None:
        assert self.listener is not None
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([self.listener, *self.children], [], [], 2.0)
            for r in ready:
                if r is self.listener:
                    self._accept()
                    last = time.monotonic()
                else:
                    self._reap(r)
                    last = time.monotonic()
            if not self.still_ours():
                return
            if not self.children and time.monotonic() - last > self.idle_s:
                return

    def _accept(self) -> None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        _, uid, _ = peer_cred(conn)
        if uid != os.getuid():  # the folder's 0700 keeps others out; the kernel's word on the peer makes sure
            print(f"mxlaunch zygote: refused a request from uid {uid} (not this user)", flush=True)
            conn.close()
            return
        try:
            conn.settimeout(10.0)
            _, fds, _, _ = socket.recv_fds(conn, 1, 2)
            if len(fds) != 2:
                raise ValueError("the request carries no output and lifeline")
            with conn.makefile("rb") as f:
                req = json.loads(f.readline())
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            print(f"mxlaunch zygote: a bad request ({exc})", flush=True)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the loop
            code = 1
            try:
                assert self.listener is not None
                self.listener.close()
                conn.close()
                for pidfd, (_, other) in self.children.items():
                    os.close(pidfd)
                    other.close()
                code = become_engine(req, fds[0], fds[1], self.entry)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            pass
        self.children[os.pidfd_open(pid)] = (pid, conn)

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        try:
            conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        if self.still_ours():
            for path in (self.path, self.info_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        else:  # replaced or removed: the info file is ours only if it still names this process
            try:
                with open(self.info_path, encoding="utf-8") as f:
                    mine = json.load(f).get("pid") == os.getpid()
            except (OSError, ValueError):
                mine = False
            if mine:
                try:
                    os.unlink(self.info_path)
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
