"""Stop signals whose work runs outside the signal handler.

Python runs a signal handler in the main thread between two bytecodes — possibly inside a `with lock:` the
handler itself then needs (`threading.Event.set` takes its Condition's lock, which is not reentrant). A
handler that cancels work through an Event can hang the process for good. CI saw it: scancel's second
SIGTERM arrived while the launcher's first handler was inside `Event.set`, and the launcher hung until its
stop watchdog killed it (exit 143, the engine's clean exit lost). Here the handler only records the signal,
runs what is safe there (`immediate`: `os.killpg`, appending to a list), and writes one byte to a pipe; a
thread of its own runs `deferred` (anything that takes a lock).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Iterable, Optional


class SignalRelay:
    """`with SignalRelay((SIGINT, SIGTERM), immediate=..., deferred=...):` — the handlers for the block."""

    def __init__(self, signals: Iterable[int], *, immediate: Callable[[int], None] = lambda s: None,
                 deferred: Callable[[int], None] = lambda s: None) -> None:
        self.signals = tuple(signals)
        self.immediate, self.deferred = immediate, deferred
        self.received: list[int] = []
        self._previous: dict = {}
        self._write: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    def _handler(self, signum: int, _frame: object) -> None:
        self.received.append(signum)  # a list append takes no lock the interrupted code could hold
        self.immediate(signum)
        if self._write is not None:
            try:
                os.write(self._write, bytes((signum & 0xFF,)))
            except OSError:
                pass  # the relay is closing: its deferred work is no longer wanted

    def _relay(self, read: int) -> None:
        while True:
            try:
                got = os.read(read, 1)
            except OSError:
                break
            if not got:
                break
            self.deferred(got[0])
        os.close(read)

    def __enter__(self) -> "SignalRelay":
        read, self._write = os.pipe()
        self._thread = threading.Thread(target=self._relay, args=(read,), name="mx-signal", daemon=True)
        self._thread.start()
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        write, self._write = self._write, None
        if write is not None:
            os.close(write)  # the relay thread reads EOF and ends
        if self._thread is not None:
            self._thread.join(5)
