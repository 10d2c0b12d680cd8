"""Can this node checkpoint an initialized engine and restore it (CRIU + CUDA checkpoint)?

An engine snapshot has two halves, and a node may allow one and not the other:
- the GPU half: the CUDA driver's checkpoint API (`cuCheckpointProcessLock/Checkpoint/Restore/Unlock`,
  driver 570+; NVIDIA's `cuda-checkpoint` tool is a thin wrapper) moves a process's GPU state into its host
  memory and back. It needs no privilege beyond owning the process.
- the host half: CRIU dumps the process tree to files and recreates it. It needs CAP_CHECKPOINT_RESTORE (or
  CAP_SYS_ADMIN) and the `criu` binary; most HPC sites and unprivileged containers deny the capability.

The parsing is pure (the status text and the tools' presence are injected) so tests need neither.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from mxlaunch import settings

CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40  # Linux 5.9+
CRIU_ENV = settings.CRIU  # the CRIU to run (e.g. the kit's run.sh); else `criu` on PATH
CUDA_CHECKPOINT_SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                           "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")


def effective_caps(status_text: str) -> int:
    """The CapEff bit mask of a /proc/<pid>/status text (0 when absent)."""
    found = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status_text, re.M)
    return int(found.group(1), 16) if found else 0


@dataclass
class CheckpointSupport:
    """What the node offers each half; `blockers` say what stops a full engine snapshot, each with its fix."""

    caps_ok: bool
    criu: Optional[str]
    cuda_api: Optional[bool]  # None: no CUDA driver here to ask
    driver_version: Optional[int] = None
    blockers: list[str] = field(default_factory=list)

    @property
    def gpu_half(self) -> bool:
        return bool(self.cuda_api)

    @property
    def full(self) -> bool:
        return not self.blockers


CRIU_FIX = ("install CRIU 4.0+ (Debian 13: apt install criu; elsewhere scripts/kits/build_criu_kit.sh "
            "builds one with its libraries)")


def criu_binary(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """$MXLAUNCH_CRIU if it names an executable, else `criu` on PATH, else None."""
    given = settings.criu(environ)
    if given:
        return given if os.access(given, os.X_OK) else None
    return shutil.which("criu", path=environ.get("PATH"))


def criu_version(text: str) -> Optional[tuple[int, ...]]:
    """The version `criu --version` prints ("Version: 4.1.1"), or None."""
    found = re.search(r"Version:\s*([0-9]+(?:\.[0-9]+)*)", text)
    return tuple(int(x) for x in found.group(1).split(".")) if found else None


def kernel_version(release: str) -> tuple[int, ...]:
    """(6, 18) of "6.18.44-fc-v1252"."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def socket_blocker(criu_ver: Optional[tuple[int, ...]], release: str) -> Optional[str]:
    """CRIU before 4.2 fails on a TCP socket on 6.16+ kernels (getsockopt(SO_PASSCRED) is refused there,
    criu#2705): an engine (its HTTP socket) cannot be dumped; a zygote (no TCP socket) can."""
    if criu_ver is not None and criu_ver < (4, 2) and kernel_version(release) >= (6, 16):
        return (f"criu {'.'.join(map(str, criu_ver))} cannot dump a TCP socket on kernel {release} (6.16+) — "
                "use CRIU 4.2 or newer (scripts/kits/build_criu_kit.sh builds 4.2.1)")
    return None


def assess(caps: int, criu: Optional[str], cuda_api: Optional[bool], driver_version: Optional[int] = None,
           criu_ver: Optional[tuple[int, ...]] = None, kernel: Optional[str] = None) -> CheckpointSupport:
    """Decide from the facts; every blocker is a "problem — fix" line. kernel: the release, for the engine's
    sockets (socket_blocker)."""
    caps_ok = bool(caps >> CAP_CHECKPOINT_RESTORE & 1 or caps >> CAP_SYS_ADMIN & 1)
    blockers = []
    if not caps_ok:
        blockers.append("no CAP_CHECKPOINT_RESTORE (nor CAP_SYS_ADMIN) in this process — CRIU cannot dump or restore "
                        "it; ask the site for the capability (e.g. a container run with --cap-add CHECKPOINT_RESTORE)")
    if not criu:
        blockers.append(f"criu is not on PATH — {CRIU_FIX}")
    elif criu_ver is not None and criu_ver < (4,):
        # seen on the H200 machine and here: Debian 12's 3.17.1 fails `criu check` on 6.x kernels
        # ("vdso: Unexpected rt vDSO area bounds"); a 4.1.1 build passes it on the same kernel
        blockers.append(f"criu {'.'.join(map(str, criu_ver))} is older than 4.0 and fails on recent kernels — {CRIU_FIX}")
    elif kernel is not None and (why := socket_blocker(criu_ver, kernel)):
        blockers.append(why)
    if cuda_api is False:
        shown = f" (driver API {driver_version})" if driver_version else ""
        blockers.append(f"the CUDA driver has no checkpoint API{shown} — it needs driver 570 or newer")
    return CheckpointSupport(caps_ok, criu, cuda_api, driver_version, blockers)


def cuda_checkpoint_api(load: Callable[[str], object] = ctypes.CDLL) -> tuple[Optional[bool], Optional[int]]:
    """Whether libcuda exports the checkpoint API, and the driver's API version; (None, None) without a driver.
    Loading libcuda does not create a CUDA context, so the launcher stays GPU-free."""
    try:
        lib = load("libcuda.so.1")
    except OSError:
        return None, None
    version = ctypes.c_int(0)
    try:
        lib.cuDriverGetVersion(ctypes.byref(version))
    except (AttributeError, OSError):
        pass
    return all(hasattr(lib, name) for name in CUDA_CHECKPOINT_SYMBOLS), version.value or None


def probe(status_path: Path = Path("/proc/self/status")) -> CheckpointSupport:
    """This process on this node."""
    try:
        caps = effective_caps(status_path.read_text())
    except OSError:
        caps = 0
    api, version = cuda_checkpoint_api()
    criu = criu_binary()
    return assess(caps, criu, api, version, criu_version(run_quietly([criu, "--version"])) if criu else None,
                  kernel=os.uname().release)


def run_quietly(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
