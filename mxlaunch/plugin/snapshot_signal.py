"""Make an engine process dumpable on request: SIGUSR2 → shut NVML down, report the GPU files still open.

Why a signal: CRIU cannot dump a process holding /dev/nvidia* files, and the NVML handle the engine's imports
leave open (vLLM 0.26's platform detection, torch's device count) can only be shut down from inside the
process. The CUDA context's own files are the driver checkpoint's business (cuCheckpointProcessCheckpoint
releases them); NVML's are not. The launcher decides when (an idle, ready engine), so the process waits for
its signal instead of guessing. Installed only where $MXLAUNCH_SNAPSHOT_DIR names the report folder, and only
from the main thread (the only one that may set a handler); whoever uses NVML next initialises it again.

Report: <dir>/<pid>.released, JSON {"pid", "device_files"} written by rename (never seen half-written).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any, Mapping

from mxlaunch import settings

SIGNAL = signal.SIGUSR2
SUFFIX = ".released"


def report_path(folder: str, pid: int) -> str:
    return os.path.join(folder, f"{pid}{SUFFIX}")


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """Install the handler when the launcher asked for it; True when installed. Never raises."""
    folder = environ.get(settings.SNAPSHOT_DIR)
    if not folder or threading.current_thread() is not threading.main_thread():
        return False
    try:
        signal.signal(SIGNAL, lambda _sig, _frame: release_and_report(folder))
    except (ValueError, OSError):
        return False
    return True


def release_and_report(folder: str) -> dict[str, Any]:
    """Shut NVML down and say which GPU device files this process still holds."""
    from mxlaunch.plugin.zygote import device_files, release_nvml  # noqa: PLC0415 — only when signalled

    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        release_nvml()
        report["device_files"] = device_files()
        path = report_path(folder, os.getpid())
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 — a handler must never take the engine down
        report["error"] = str(exc)
    return report
