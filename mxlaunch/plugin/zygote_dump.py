"""The zygote standing still for a CRIU dump (`--image-log`): nothing a dump cannot take, a marker, a resume file.

Why a module of its own: what CRIU needs of the process (no GPU device files: NVML shut down; every descriptor
on /dev/null; no socket yet) and the marker handshake with the launcher (warmstart/zygote_image.py: `<key>.dumpable`
claimed, `<key>.resume` says where to log) are one job, apart from serving. The engine snapshot's signal
handler (plugin/snapshot_signal.py) takes the same NVML release and device-file scan.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional

from mxlaunch.contract import ZYGOTE_DUMPABLE, ZYGOTE_RESUME
from mxlaunch.plugin.zygote_child import _reseed
from mxlaunch.plugin.zygote_server import beside


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
