"""The launcher's log files (engine.log, zygote.log): this user's alone, never written through a planted name.

An engine log holds what the engine prints — its arguments among it (SGLang logs its server_args, API key
included; the launcher scrubs the launch's known secrets on the way, mxlaunch/safety/redact.py Scrubber) — so it is
created 0600, and an older log left 0644 is made 0600 when it is opened again.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO, Optional

from mxlaunch.safety.ownership import ForeignPath, open_judged


def open_log(path: str | os.PathLike[str], *, append: bool = False) -> BinaryIO:
    """`path` opened for writing (append, or emptied): created 0600, never through a symbolic link (O_NOFOLLOW),
    never a FIFO or another user's file (ForeignPath, one line). An existing file of ours is made 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0)
    try:
        fd, why = open_judged(path, flags, _ours, mode=0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # ELOOP: a symbolic link; ENXIO: a FIFO nobody reads
            raise ForeignPath(f"{path} is a symbolic link or a FIFO, not a log file",
                              "remove it; mxlaunch writes logs only into files of its own") from exc
        raise
    if fd is None:
        raise ForeignPath(f"{path} {why}", "remove it; mxlaunch writes logs only into files of its own")
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        if not append:
            os.ftruncate(fd, 0)
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise


def _ours(st: os.stat_result) -> Optional[str]:
    """A log's rule: a regular file of this user's (its mode is then narrowed to 0600, not refused)."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return "is not a regular file of this user's"
    return None
