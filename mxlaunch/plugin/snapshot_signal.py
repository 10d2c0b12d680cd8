"""Make an engine process dumpable on request: SIGUSR2 → shut NVML down, report the GPU files still open.

Why a signal: CRIU cannot dump a process holding /dev/nvidia* files, and the NVML handle the engine's imports
leave open (vLLM 0.26's platform detection, torch's device count) can only be shut down from inside the
process. The CUDA context's own files are the driver checkpoint's business (cuCheckpointProcessCheckpoint
releases them); NVML's are not. The launcher decides when (an idle, ready engine), so the process waits for
its signal instead of guessing. Installed only where $MXLAUNCH_SNAPSHOT_DIR names the report folder, and only
from the main thread (the only one that may set a handler); whoever uses NVML next initialises it again.

Report: <dir>/<pid>.released, JSON {"pid", "device_files"} written by rename (never seen half-written).

Actions (vLLM's API server, started with --enable-sleep-mode): when the launcher has written
<dir>/<pid>.action ("sleep" or "wake") before the signal, the handler instead asks the engine client in this
process (vLLM's AsyncLLM, found once and kept) to sleep at level 1 (weights to host memory, the KV cache
discarded, the prefix cache reset) or to wake up, as a task on the running event loop — the way vLLM's own
/sleep and /wake_up routes do, without opening those development routes on the server's port. Its report is
<dir>/<pid>.<action>.done, JSON {"pid", "action", "error"}. Why: the KV cache is most of an engine snapshot's
GPU memory and its contents are garbage in an idle engine; left out, the image is smaller and restores faster.

A lean snapshot (plugin/weight_refill.py) sleeps at level 2 instead ("sleep-lean": the weights discarded too,
their addresses kept) and is woken by "refill <plan file>": the weights' memory woken, every worker's
`mxlaunch_refill` (vLLM's --worker-extension-cls) copying its rank's files of that plan into it, then the KV
cache woken. The refill's per-rank results are in the report's "result".

The folder is in the run folder in /dev/shm: the handler is installed only when it is this user's alone
(ownership.untrusted_path), reads the action file only as this user's own regular file (no link, no FIFO that
would block the handler), and writes its reports by a new temp file (O_EXCL | O_NOFOLLOW) renamed into place:
a link planted under either name is never written through.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from typing import Any, Mapping, Optional

from mxlaunch import settings
from mxlaunch.contract import (FINGERPRINT_METHOD, REFILL_METHOD, SNAPSHOT_RELEASED, SNAPSHOT_SIGNAL_NUMBER,
                               snapshot_action_path, snapshot_done_path)
from mxlaunch.errors import UsageError
from mxlaunch.safety.ownership import create_own, open_own, untrusted_path

SIGNAL = signal.Signals(SNAPSHOT_SIGNAL_NUMBER)  # SIGUSR2: the protocol is mxlaunch/contract.py's
SUFFIX = SNAPSHOT_RELEASED
ACTIONS = ("sleep", "sleep-lean", "wake", "refill")
SLEEP_LEVEL = 1  # weights kept (in host memory), the KV cache dropped
LEAN_LEVEL = 2  # the weights discarded too: a refill brings them back (plugin/weight_refill.py)
MAX_ORDER = 4096  # an action and its argument (a plan file's path)
_client: Optional[Any] = None  # the engine client, once found (kept in the snapshot's image, so a restore has it)
_tasks: set = set()  # actions under way: the loop keeps only weak references to its tasks


def report_path(folder: str, pid: int) -> str:
    return os.path.join(folder, f"{pid}{SUFFIX}")


action_path, done_path = snapshot_action_path, snapshot_done_path


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """Install the handler when the launcher asked for it; True when installed. Never raises."""
    folder = environ.get(settings.SNAPSHOT_DIR)
    if not folder or threading.current_thread() is not threading.main_thread():
        return False
    why = untrusted_path(folder, is_dir=True)
    if why:
        logging.getLogger("mxlaunch").warning("mxlaunch: no engine snapshot from this process: %s=%s refused: %s",
                                              settings.SNAPSHOT_DIR, folder, why)
        return False
    try:
        signal.signal(SIGNAL, lambda _sig, _frame: on_signal(folder))
    except (ValueError, OSError):
        return False
    return True


def on_signal(folder: str) -> None:
    """The handler: the action the launcher wrote for this process, else the NVML release."""
    try:
        with os.fdopen(open_own(action_path(folder, os.getpid())), encoding="utf-8") as f:
            order = f.read(MAX_ORDER)
        os.unlink(action_path(folder, os.getpid()))
    except (OSError, UsageError):
        order = ""
    action, arg = parse_order(order)
    if action in ACTIONS:
        start_action(folder, action, arg)
    else:
        release_and_report(folder)


def parse_order(order: str) -> tuple[str, str]:
    """An action file's text → (action, argument): "sleep", "wake", "sleep-lean", "refill <plan file>"."""
    action, _, arg = order.strip().partition(" ")
    return action, arg.strip()


def action_work(client: Any, action: str, arg: str = "") -> Any:
    """The coroutine that carries out `action` on the engine client (vLLM's AsyncLLM)."""
    if action == "sleep":
        return client.sleep(SLEEP_LEVEL)
    if action == "sleep-lean":
        if not arg:
            raise ValueError("sleep-lean needs the plan file the engine will refill from")
        return _sleep_lean(client, arg)
    if action == "wake":
        return client.wake_up(None)
    if action == "refill":
        if not arg:
            raise ValueError("refill needs the plan file to refill from")
        return _refill(client, arg)
    raise ValueError(f"unknown action {action!r}")


class NotLean(Exception):
    """The plan's files cannot refill this engine (another layout): nothing was changed, no lean sleep."""


async def _sleep_lean(client: Any, plan: str) -> Any:
    """Every worker checks that the plan's files fit its live tensors and takes their fingerprint (which the
    refill must match), then the engine sleeps at level 2. A misfit raises NotLean before anything changed."""
    checked = await client.collective_rpc(FINGERPRINT_METHOD, args=(plan,))
    why = [r["why"] for r in checked or [] if isinstance(r, dict) and r.get("why")]
    if why:
        raise NotLean(why[0])
    await client.sleep(LEAN_LEVEL)
    return checked


async def _refill(client: Any, plan: str) -> Any:
    """Wake the weights' memory, refill it on every worker, then wake the KV cache. Should the refill fail,
    the KV cache stays asleep: an engine with wrong weights must not take a request."""
    await client.wake_up(["weights"])
    result = await client.collective_rpc(REFILL_METHOD, args=(plan,))
    await client.wake_up(["kv_cache"])
    return result


def start_action(folder: str, action: str, arg: str = "") -> None:
    """Run `action` on this process's engine client as a task on the running event loop; its outcome goes to
    done_path. Never raises: a failure is the report's "error"."""
    try:
        import asyncio  # noqa: PLC0415

        loop = asyncio.get_running_loop()  # the handler runs on the main thread, inside the server's loop
        client = engine_client()
        if client is None:
            raise LookupError("no engine client (vLLM's AsyncLLM) in this process")

        def begin() -> None:
            try:
                task = loop.create_task(action_work(client, action, arg))
                _tasks.add(task)

                def done(t: Any) -> None:
                    _tasks.discard(t)
                    error = None if t.cancelled() else t.exception()
                    _write_done(folder, action, error, None if error or t.cancelled() else t.result())

                task.add_done_callback(done)
            except Exception as exc:  # noqa: BLE001
                _write_done(folder, action, exc)

        # Threadsafe although this is the loop's thread: the handler may run inside the loop's own wait for
        # events (a plain asyncio loop retries its epoll after the signal), which only the self-pipe ends.
        loop.call_soon_threadsafe(begin)
    except Exception as exc:  # noqa: BLE001 — a handler must never take the engine down
        _write_done(folder, action, exc)


def engine_client() -> Optional[Any]:
    """vLLM's AsyncLLM in this process (an API server has one): found once among the live objects, then kept.

    vLLM's server freezes its start-up heap (`gc.freeze()`), and frozen objects are not in `gc.get_objects()`
    (seen on the H200: "no engine client"): the search unfreezes them for its duration and freezes again."""
    global _client
    if _client is None:
        import gc  # noqa: PLC0415

        frozen = gc.get_freeze_count()
        gc.unfreeze()  # moves the frozen objects back into the oldest generation (a list splice, not a copy)
        try:
            for obj in gc.get_objects():
                if type(obj).__name__ == "AsyncLLM" and callable(getattr(obj, "sleep", None)) \
                        and callable(getattr(obj, "wake_up", None)):
                    _client = obj
                    break
        finally:
            if frozen:
                gc.freeze()
    return _client


def write_report(path: str, obj: Any) -> None:
    """`obj` as JSON at `path` by `<path>.tmp`, a new file (create_own: O_EXCL | O_NOFOLLOW) renamed into place:
    whatever lies under either name (a planted link included) is replaced, never written through."""
    tmp = f"{path}.tmp"
    try:
        fd = create_own(tmp)
    except FileExistsError:
        os.unlink(tmp)  # a leftover, or something planted: the name goes, not what it points to
        fd = create_own(tmp)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _write_done(folder: str, action: str, error: Optional[BaseException], result: Any = None) -> None:
    path = done_path(folder, os.getpid(), action)
    try:
        write_report(path, {"pid": os.getpid(), "action": action,
                            "error": f"{type(error).__name__}: {error}" if error else None,
                            **({"result": json.loads(json.dumps(result, default=str))} if result is not None else {})})
    except (OSError, TypeError, ValueError):
        pass


def release_and_report(folder: str) -> dict[str, Any]:
    """Shut NVML down and say which GPU device files this process still holds."""
    from mxlaunch.plugin.zygote_dump import device_files, release_nvml  # noqa: PLC0415 — only when signalled

    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        release_nvml()
        report["device_files"] = device_files()
        write_report(report_path(folder, os.getpid()), report)
    except Exception as exc:  # noqa: BLE001 — a handler must never take the engine down
        report["error"] = str(exc)
    return report
