"""Progress bars for long byte-moving work: GiB/s on a TTY, silent elsewhere (logs, --json, CI)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text


class GiBPerSecond(ProgressColumn):
    """Throughput in binary units, the way storage people read it."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("—" if speed is None else f"{speed / (1 << 30):.2f} GiB/s", style="progress.data.speed")


class GiBDone(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.completed / (1 << 30):.2f}/{(task.total or 0) / (1 << 30):.2f} GiB")


@contextmanager
def byte_progress(console: Console, total: int, label: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield an `advance(nbytes)` callable, thread-safe; draws only when the console is a terminal."""
    if not enabled or not console.is_terminal:
        yield lambda _n: None
        return
    lock = threading.Lock()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), GiBDone(), GiBPerSecond(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(label, total=total)

        def advance(nbytes: int) -> None:
            with lock:
                progress.update(task, advance=nbytes)

        yield advance
