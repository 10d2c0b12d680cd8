"""A store-held image (a zygote image, a lean engine snapshot) staged into /dev/shm before CRIU restores it.

Why: CRIU reads an image with one buffered reader, after a separate pass that checked its sums (image_sums.py):
two reads of a few GB, one thread each, from a store that may be Lustre or a disk whose cache was dropped
(the H200's lean restore: 1.5-2.6 s in CRIU for 2.7 GB, after the check). The stage's readers (parallel,
O_DIRECT, staging/reader.py) copy the image once at the store's speed and check each file's xxh3-128 against
sums.json as it lands; CRIU then reads memory. And what is checked is what is restored: the copy sits in a
folder of this user's alone, which nobody can change between the check and the restore.

A node without the room for the copy restores from the store as before (`NoRoom`: the caller checks the sums
in place); a file that differs from its sum, or one missing or unknown, refuses the image (`ImageDamaged`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Optional

from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.safety.ownership import private_dir
from mxlaunch.warmstart.image_sums import SUMS, image_files

IMAGE_READERS = 16  # an image is a few large page files and many small ones: more readers than that buy nothing


class ImageDamaged(Exception):
    """The image's files differ from its sums.json: it must not be restored."""


class NoRoom(Exception):
    """No room for the copy where it would go: restore from the store, checked in place."""


def stage_image(folder: Path, dest_root: Path, readers: int = IMAGE_READERS, reserve_bytes: int = 0) -> tuple[Path, dict]:
    """Copy the image in `folder` into a new private folder under `dest_root`, every file checked against
    `folder`'s sums.json as it lands; (the copy, {"image_stage_s", "image_gib_per_s", "o_direct"}). The caller
    restores from the copy and removes it (`remove_copy`); nothing is left behind when this raises.
    `reserve_bytes`: room to leave for what is staged after it (a lean restore's weights): without it, NoRoom."""
    from mxlaunch.staging.reader import StageJob
    from mxlaunch.staging.sources import CopyItem

    try:
        sums = json.loads((folder / SUMS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ImageDamaged(f"its {SUMS} cannot be read: {exc}") from None
    have = {str(p.relative_to(folder)): p for p in image_files(folder)}
    if not isinstance(sums, dict) or not all(isinstance(v, dict) and v.get("xxh3_128") and isinstance(v.get("bytes"), int)
                                             for v in sums.values()):
        raise ImageDamaged(f"its {SUMS} does not give every file its size and checksum")
    if set(have) != set(sums):
        extra, lost = sorted(set(have) - set(sums)), sorted(set(sums) - set(have))
        raise ImageDamaged(f"its files differ from {SUMS}: {len(lost)} missing {lost[:3]}, {len(extra)} unknown {extra[:3]}")
    items = [CopyItem(src=path, rel=rel, size=path.stat().st_size) for rel, path in sorted(have.items())]
    try:
        dest = Path(tempfile.mkdtemp(prefix="image-", dir=dest_root))  # 0700, a new name: nobody else's file in it
    except OSError as exc:
        raise NoRoom(f"no folder for the copy in {dest_root}: {exc.strerror or exc}") from None
    job = None
    try:
        job = StageJob(items, dest, readers=max(1, min(readers, len(items))), expected=sums, huge_pages=False,
                       reserve_bytes=reserve_bytes)
        result = job.start().wait()
        for rel, src in have.items():  # the copy as the image is: the restore puts files back with their mode
            st = src.stat()            # (CRIU checks it), whatever the umask gave the copy
            os.chmod(dest / rel, stat.S_IMODE(st.st_mode))
            os.utime(dest / rel, ns=(st.st_atime_ns, st.st_mtime_ns))
    except BaseException as exc:
        if job is not None:  # no reader may still write into the folder that goes now (an interrupt, say)
            job.cancel()
            job.finished(10.0)
        remove_copy(dest)
        if isinstance(exc, (UsageError, CheckFailed, OSError)):
            raise _why(exc) from None
        raise
    return dest, {"image_stage_s": round(result.seconds, 3), "image_gib_per_s": round(result.gib_per_s, 3),
                  "o_direct": result.o_direct}


def _why(exc: BaseException) -> Exception:
    """A failed copy as what the caller does about it: NoRoom (restore in place) or ImageDamaged (no restore)."""
    if isinstance(exc, UsageError):  # the stage's preflight: not enough room in dest_root
        return NoRoom(exc.one_line())
    cause = exc.__cause__ if isinstance(exc, CheckFailed) else exc
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
        return NoRoom(f"the copy ran out of room: {cause.strerror}")  # the weights' stage took it meanwhile
    if isinstance(exc, CheckFailed):  # a file that is not what was published (sizes, then each file's xxh3-128)
        return ImageDamaged(exc.one_line())
    return ImageDamaged(f"reading it failed: {getattr(exc, 'strerror', None) or exc}")  # the store went away, I/O


def remove_copy(dest: Optional[Path]) -> None:
    """The staged copy, once CRIU has read it (its pages are in the restored processes' memory by then)."""
    if dest is not None:
        shutil.rmtree(dest, ignore_errors=True)


def staging_root(candidate: Optional[Path]) -> Optional[Path]:
    """Where a copy may go: `candidate` (the run folder) when it is a real folder of this user's that nobody
    else can enter; else None (restore from the store)."""
    return candidate if candidate is not None and private_dir(candidate) else None


__all__ = ["IMAGE_READERS", "ImageDamaged", "NoRoom", "remove_copy", "stage_image", "staging_root"]
