"""The engine process and its output, the same for `launch` and `profile -- CMD`.

The engine runs in its own session (process group), so a signal reaches all its workers; it dies with
the launcher (PR_SET_PDEATHSIG). Its output is read in chunks and split into lines at \\n and at \\r
(tqdm redraws progress bars with \\r), so both commands see the same lines from the same engine.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Tuple

from mxlaunch.warmstart import no_io_uring

_BREAK = re.compile(rb"\r\n|\r|\n")


def _pdeathsig() -> None:
    """Runs in the engine child: die with the launcher (SIGTERM lets the engine stop its own workers)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, *, stdin: Optional[int] = None,
          die_with_parent: bool = True, dumpable: bool = False) -> subprocess.Popen:
    """The engine in its own process group, stdout and stderr together on one pipe. dumpable: no io_uring
    in its tree (warmstart/no_io_uring.py), and no PR_SET_PDEATHSIG: CRIU restores it, and the restored root
    would get it the moment CRIU (its parent then) exits — so CRIU can snapshot it — and stdin /dev/null unless
    one is given: CRIU refuses a tree holding a terminal it did not get the master of ("tty: Found slave peer
    index 0 without correspond master peer", a launch from an interactive shell), and a restore could only
    hand it a dead copy of the first launcher's stdin anyway."""
    die_with_parent = die_with_parent and not dumpable
    if dumpable and stdin is None:
        stdin = subprocess.DEVNULL

    def preexec() -> None:
        if die_with_parent:
            _pdeathsig()
        if dumpable:
            no_io_uring.install()

    return subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin,
                            env=dict(env) if env is not None else None, start_new_session=True,
                            preexec_fn=preexec if die_with_parent or dumpable else None)


def read_lines(fd: int, on_line: Callable[[str, float], None], start: float,
               on_chunk: Optional[Callable[[bytes], None]] = None) -> None:
    """Read `fd` to its end: each raw chunk to `on_chunk` (the log file), each complete line (\\n or \\r)
    to `on_line(text, seconds since start)`; an unfinished last line is delivered at the end."""
    tail = b""
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if on_chunk is not None:
                on_chunk(chunk)
            now = time.monotonic() - start
            parts = _BREAK.split(tail + chunk)
            tail = parts.pop()
            for part in parts:
                on_line(part.decode("utf-8", errors="replace"), now)
    except OSError:
        pass
    finally:
        if tail:
            on_line(tail.decode("utf-8", errors="replace"), time.monotonic() - start)


Step = Tuple[Optional[int], float]  # (signal to send, or None: one already sent; seconds to wait after it)


def stop_steps(grace: Tuple[float, float] = (15.0, 10.0)) -> Tuple[Step, ...]:
    """The usual sequence: SIGINT, grace[0] s; SIGTERM, grace[1] s; SIGKILL, 5 s."""
    return ((signal.SIGINT, grace[0]), (signal.SIGTERM, grace[1]), (signal.SIGKILL, 5.0))


def stop_group(proc: subprocess.Popen, grace: Tuple[float, float] = (15.0, 10.0), *,
               steps: Optional[Sequence[Step]] = None, since: Optional[float] = None,
               interrupted: Optional[Callable[[], bool]] = None) -> None:
    """Stop the command's whole process group, one step after the other, each until the group is gone:
    by default SIGINT, then SIGTERM, then SIGKILL (`stop_steps(grace)`). A step with signal None is a
    signal already sent at `since` (time.monotonic()): its wait counts from then. `interrupted()` true
    ends the sequence early, so that the caller can continue with a stricter one."""
    pgid = proc.pid  # started with start_new_session: its own group
    for sig, wait in steps if steps is not None else stop_steps(grace):
        if not group_alive(pgid) and proc.poll() is not None:
            return
        if interrupted is not None and interrupted():
            return
        start = time.monotonic()
        if sig is None:
            start = since if since is not None else start
        else:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = start + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                return
            if interrupted is not None and interrupted():
                return
            time.sleep(0.05)
    try:
        proc.wait(timeout=5 if steps is None else 0.5)
    except subprocess.TimeoutExpired:
        pass


def group_alive(pgid: int) -> bool:
    """Any live member left? Zombies count as gone (a container's PID 1 may never reap them)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        return True
    for stat in proc_root.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def kill_group(proc: subprocess.Popen, wait: float = 0.0) -> None:
    """SIGKILL whatever is left in the group (workers that outlived the engine's main process), and wait
    up to `wait` seconds for it to be gone (its shared memory is unmapped only then)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and group_alive(proc.pid):
        time.sleep(0.05)


def log_tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def default_log_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mxlaunch" / "runs"
