"""The engine snapshot's post-dump step: which /dev/shm files the dumped tree holds, and the copy of CRIU's
link-remap files for them — run by CRIU as its action script while the engine is frozen.

Why a module of its own, with the standard library only: CRIU runs it as `python -I snapshot_files.py ...`
(no mxlaunch import, no site packages: nothing the environment could slip in) at post-dump, when the engine is
frozen and CUDA-locked, so it must never block and never take what is not the engine's. /dev/shm is every
user's: another user may put a FIFO there (an open for reading would wait for a writer, the engine frozen
meanwhile) or a planted file named like CRIU's `link_remap.<id>` (it would go into the image and be served
back to the restored engine). So a name is copied only when all of these hold:
  - lstat: a regular file (no link, FIFO, socket or device), owned by the dumping user;
  - its inode is one the dumped tree holds open or mapped (CRIU's link-remap is a hard link to such a file:
    files-reg.c create_link_remap, linkat of the held descriptor);
  - opened with O_NOFOLLOW | O_NONBLOCK and the descriptor's fstat is that same inode again.
Anything else is skipped (a line on stderr, in CRIU's log). The launcher's engine_tree.py imports the
helpers for the same rules on the named /dev/shm files it keeps.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Iterable, Optional

LINK_REMAP = "link_remap."
CHUNK = 1 << 20


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, parents first."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(kids.get(pid, [])))
    return out


def held_inodes(pids: Iterable[int], under: str = "/dev/shm") -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file below `under` that one of `pids` holds open (a descriptor: stat of the
    /proc link is the held inode, unlinked or not) or mapped (/proc/PID/maps names device and inode)."""
    prefix = under.rstrip("/") + "/"
    found: set[tuple[int, int]] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(link).startswith(prefix):
                    st = os.stat(link)
                    found.add((st.st_dev, st.st_ino))
            except OSError:
                continue
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                try:
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    found.add((os.makedev(major, minor), int(parts[4])))
                except ValueError:
                    continue
    return found


def own_held(path: str, held: set[tuple[int, int]], uid: int) -> Optional[str]:
    """Why `path` must not be taken (None: it may): by lstat, never following it."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}"
    if (st.st_dev, st.st_ino) not in held:
        return "is no file the dumped engine holds"
    return None


def copy_held(path: str, dest: str, held: set[tuple[int, int]], uid: int) -> None:
    """Copy `path` to the new file `dest` (O_EXCL), opened without following a link and without blocking, and
    only if the descriptor is an own, held regular file (the name may have been swapped since the lstat).
    Mode and times are kept (a restore puts the file back as it was). ValueError: not taken, and why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # swapped for a link (ELOOP) or removed since the lstat
        raise ValueError(f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or (st.st_dev, st.st_ino) not in held:
            raise ValueError("changed after it was examined")
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while chunk := os.read(fd, CHUNK):
                os.write(out, chunk)
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o777)  # as it was (no set-id bits): put back the same
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def keep_link_remaps(shm: str, keep: str, root_pid: int, uid: int) -> list[str]:
    """Copy the link-remap files of the tree at `root_pid` from `shm` into the new folder `keep`; their names."""
    held = held_inodes(process_tree(root_pid), shm)
    os.mkdir(keep, 0o700)
    kept = []
    for name in sorted(os.listdir(shm)):
        if not name.startswith(LINK_REMAP):
            continue
        path = os.path.join(shm, name)
        why = own_held(path, held, uid)
        if why is None:
            try:
                copy_held(path, os.path.join(keep, name), held, uid)
                kept.append(name)
                continue
            except ValueError as exc:
                why = str(exc)
        print(f"mxlaunch post-dump: not keeping {path}: it {why}", file=sys.stderr)
    return kept


def main(argv: list[str]) -> int:
    """CRIU's action script: `python -I snapshot_files.py SHM KEEP ROOT_PID UID`; acts only at post-dump."""
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
        return 0
    shm, keep, root_pid, uid = argv[0], argv[1], int(argv[2]), int(argv[3])
    try:
        keep_link_remaps(shm, keep, root_pid, uid)
    except OSError as exc:  # CRIU then fails the dump: no snapshot without the files its restore needs
        print(f"mxlaunch post-dump: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
