"""Running CRIU: dump one process tree to a folder of image files, and restore it, detached, from one.

Why a module of its own: the zygote image (warmstart/zygote_image.py) is the first user, and the engine snapshot
(issue 24) would be the next; both need the same binary lookup, the same "problem — fix" errors and the same
log handling. The binary is settings.CRIU (for example the kit `scripts/kits/build_criu_kit.sh` builds:
`.criu4-kit/run.sh`), else `criu` on PATH. CRIU older than 4.0 fails on recent kernels, so it is not used.

What a restore needs (measured, docs/benchmarks.md): the original pid and thread ids free on this node, the
same files (libraries, the interpreter) at the same paths with the same sizes, and CAP_CHECKPOINT_RESTORE.
CRIU checks the files itself and refuses a mismatch; every failure here is a `CriuError` carrying the
tail of CRIU's own log, and the caller falls back to importing as usual.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from mxlaunch.warmstart.engine_checkpoint import CRIU_ENV, assess, criu_binary, criu_version, effective_caps, run_quietly

__all__ = ["CLOCKS_IMAGE", "CRIU_ENV", "CriuError", "criu_binary", "dump", "restore", "why_not"]


class CriuError(Exception):
    """A dump or restore that failed; the message ends with CRIU's last log lines."""


def why_not(environ: Mapping[str, str] = os.environ, status_text: Optional[str] = None) -> tuple[Optional[str], str]:
    """(the criu to run, "") when this process may dump and restore its children; else (None, why not) — the
    engine snapshot's host-half rules (engine_checkpoint.assess), without its GPU half."""
    binary = criu_binary(environ)
    if binary is None:
        where = f"{CRIU_ENV}={environ[CRIU_ENV]} is not executable" if environ.get(CRIU_ENV) else "no criu on PATH"
        return None, f"{where} (scripts/kits/build_criu_kit.sh builds CRIU 4.2.1; point {CRIU_ENV} at its run.sh)"
    if status_text is None:
        try:
            status_text = Path("/proc/self/status").read_text()
        except OSError:
            status_text = ""
    version = criu_version(run_quietly([binary, "--version"]))
    if version is None:
        return None, f"{binary} --version printed no version"
    blockers = assess(effective_caps(status_text), binary, None, criu_ver=version).blockers
    return (None, blockers[0].split(" — ")[0]) if blockers else (binary, "")


# CRIU keeps a restored tree's CLOCK_MONOTONIC/BOOTTIME continuous by restoring it into a new time namespace
# offset by the time since the dump. Every process forked there then reads its own start time in /proc shifted
# by that offset, and other processes (which read the real one) take it for a recycled pid: a P2P source's record
# was judged "process gone" this way. Without this image CRIU restores into the node's own clocks.
CLOCKS_IMAGE = "timens-0.img"


def dump(binary: str, pid: int, images: Path, timeout: float = 120.0, keep_clocks: bool = False,
         extra: tuple[str, ...] = ()) -> None:
    """Dump the tree rooted at `pid` into `images` (made here); CRIU stops the tree once it is dumped.
    The tree must be a session of its own with no terminal (the zygote is: start_new_session, fds on files).
    keep_clocks=False: the restore runs on the node's clocks (see CLOCKS_IMAGE). extra: more CRIU flags (the
    engine snapshot's, warmstart/engine_snapshot.py)."""
    images.mkdir(parents=True, mode=0o700, exist_ok=True)
    _run(binary, ["dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v2", *extra], images / "dump.log",
         timeout)
    if not keep_clocks:
        (images / CLOCKS_IMAGE).unlink(missing_ok=True)


def restore(binary: str, images: Path, work: Path, timeout: float = 60.0, extra: tuple[str, ...] = (),
            pass_fds: tuple[int, ...] = ()) -> int:
    """Restore the tree in `images`, detached (`-d`: it runs on once CRIU exits), in this process's cgroups;
    its pid. CRIU writes its log and pid file into `work` (the image folder may be shared and read-only to
    others)."""
    work.mkdir(parents=True, exist_ok=True)
    pidfile = work / "restored.pid"
    pidfile.unlink(missing_ok=True)
    # --manage-cgroups=ignore: the tree joins the restoring launcher's cgroups (a Slurm job's, say), never the
    # ones it was dumped from (another job's, maybe gone)
    _run(binary, ["restore", "-d", "-D", str(images), "-W", str(work), "-o", str(work / "restore.log"), "-v2",
                  "--manage-cgroups=ignore", "--pidfile", str(pidfile), *extra], work / "restore.log", timeout,
         pass_fds)
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError) as exc:
        raise CriuError(f"criu restore wrote no pid file ({exc})") from None


def _run(binary: str, args: list[str], log: Path, timeout: float, pass_fds: tuple[int, ...] = ()) -> None:
    try:
        done = subprocess.run([binary, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, pass_fds=pass_fds)
    except subprocess.TimeoutExpired:
        raise CriuError(f"criu {args[0]} took over {timeout:.0f} s{_tail(log)}") from None
    except OSError as exc:
        raise CriuError(f"cannot run {binary}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise CriuError(f"criu {args[0]} exited {done.returncode}{': ' + said[-1] if said else ''}{_tail(log)}")


def _tail(log: Path, lines: int = 3) -> str:
    """CRIU's last error lines (its log says what it refused: a pid in use, a file of another size)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.strip() for line in text if "Error" in line or "error" in line][-lines:]
    return f" ({' | '.join(errors)})" if errors else ""
