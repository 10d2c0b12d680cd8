"""A reader process: O_DIRECT reads into its own aligned buffer, pwrite into the destination.

Threads in one process share one address space, so pinning pages for O_DIRECT and allocating tmpfs
pages contend on that process's memory locks; a few reader processes, each with its own buffer and
descriptors, do not. The parent (staging.reader) sends one task per line on stdin and reads one
answer per line on stdout:

    task:    <src>\t<dest>\t<offset>\t<length>\t<o_direct 0|1>
    answer:  ok\t<o_direct used 0|1>      or      err\t<errno>\t<message>

Only the standard library: the worker starts in milliseconds and imports nothing of the launcher.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import sys

ALIGN = 4096


def _die_with_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it cleans up)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Files:
    """Open descriptors by path (a handful of files are in flight at once)."""

    def __init__(self) -> None:
        self.src: dict[tuple[str, bool], int] = {}
        self.dest: dict[str, int] = {}

    def source(self, path: str, direct: bool) -> tuple[int, bool]:
        key = (path, direct)
        if key not in self.src:
            if len(self.src) > 64:
                self.close_all(self.src)
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
            try:
                self.src[key] = os.open(path, flags)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                return self.source(path, False)
        return self.src[key], direct

    def target(self, path: str) -> int:
        if path not in self.dest:
            if len(self.dest) > 64:
                self.close_all(self.dest)
            self.dest[path] = os.open(path, os.O_WRONLY)
        return self.dest[path]

    @staticmethod
    def close_all(table: dict) -> None:
        for fd in table.values():
            os.close(fd)
        table.clear()


def read_chunk(files: Files, buf: memoryview, src: str, offset: int, length: int, direct: bool) -> bool:
    """Read [offset, offset+length) of src into buf; returns whether O_DIRECT was used."""
    fd, direct = files.source(src, direct)
    padded = -(-length // ALIGN) * ALIGN if direct else length
    got = 0
    try:
        while got < length:
            n = os.preadv(fd, [buf[got:padded]], offset + got)
            if n == 0:
                raise OSError(errno.EIO, f"{src} ended at {offset + got} bytes (did it change while staging?)")
            got += n
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:  # took O_DIRECT at open, refuses the read
            return read_chunk(files, buf, src, offset, length, False)
        raise
    return direct


def main() -> int:
    _die_with_parent()
    chunk = int(sys.argv[1])
    buf = mmap.mmap(-1, chunk)
    buf.write(b"\0" * chunk)  # fault the buffer in once
    view = memoryview(buf)
    files = Files()
    out = sys.stdout
    for line in sys.stdin:
        try:
            src, dest, offset_s, length_s, direct_s = line.rstrip("\n").split("\t")
            offset, length = int(offset_s), int(length_s)
            used = read_chunk(files, view, src, offset, length, direct_s == "1")
            fd = files.target(dest)
            done = 0
            while done < length:
                done += os.pwrite(fd, view[done:length], offset + done)
            out.write(f"ok\t{int(used)}\n")
        except OSError as exc:
            out.write(f"err\t{exc.errno or errno.EIO}\t{(exc.strerror or str(exc)).replace(chr(9), ' ')}\n")
        except Exception as exc:  # noqa: BLE001 — a bad task line must not kill the worker silently
            out.write(f"err\t{errno.EINVAL}\t{type(exc).__name__}: {exc}\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
