"""A tar of JIT cache files, built and unpacked safely: every member checked before the first byte is
written (relative names only, no `..`, no links or devices — regular files and folders only — a size and a
member cap), each file written by rename (never half a file), the archive's sha256 taken while it is
written. Knows nothing of keys, records or who wrote it: that is the store's side (kernelcache/archive.py),
kept apart so the tar handling is read and tested on its own."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Callable, List, Tuple, Union

from mxlaunch.fileutil import ensure_dir

MAX_MEMBERS = 500_000


class ArchiveRefused(Exception):
    """The archive cannot be restored; str() is the one-line reason."""


def check_members(tar: tarfile.TarFile, max_bytes: int) -> List[tarfile.TarInfo]:
    """Every member, checked before anything is extracted; raises ArchiveRefused with the first problem."""
    members, total = [], 0
    for m in tar:  # reads every header (a truncated archive raises here)
        name = m.name
        parts = PurePosixPath(name).parts
        if not name or name.startswith("/") or re.match(r"^[A-Za-z]:", name) or "\\" in name:
            raise ArchiveRefused(f"member {name!r} has an absolute or non-POSIX path")
        if ".." in parts:
            raise ArchiveRefused(f"member {name!r} climbs out of the folder with '..'")
        if not (m.isreg() or m.isdir()):
            kind = "a link" if (m.issym() or m.islnk()) else "not a regular file or folder"
            raise ArchiveRefused(f"member {name!r} is {kind}")
        total += m.size if m.isreg() else 0
        if total > max_bytes:
            raise ArchiveRefused(f"the archive holds more than the {max_bytes / (1 << 30):.1f} GiB cap "
                                 "(MXLAUNCH_KERNEL_CACHE_MAX_GIB)")
        members.append(m)
        if len(members) > MAX_MEMBERS:
            raise ArchiveRefused(f"the archive has more than {MAX_MEMBERS} members")
    return members


def _inside(root: Path, path: Path) -> bool:
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root


def extract(archive: Union[Path, IO[bytes]], dest: Path, max_bytes: int) -> Tuple[int, int, int]:
    """Check every member, then write them under dest (each file by rename: never half a file). Files
    already there with the same size are kept. Returns (files, bytes) written and the files kept. `archive`
    is a path or a file already opened (and checked) by the caller."""
    files = nbytes = kept = 0
    opened = tarfile.open(archive, "r:") if isinstance(archive, Path) else tarfile.open(fileobj=archive, mode="r:")
    with opened as tar:
        members = check_members(tar, max_bytes)
        ensure_dir(dest)
        for m in members:
            target = dest / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                if not _inside(dest, target):
                    raise ArchiveRefused(f"{target} leads out of {dest} (a link on this node)")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if not _inside(dest, target.parent) or target.is_symlink():
                raise ArchiveRefused(f"{target} leads out of {dest} (a link on this node)")
            if target.is_file() and target.stat().st_size == m.size:
                kept += 1
                continue
            src = tar.extractfile(m)
            assert src is not None
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
            try:
                with src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                    if out.tell() != m.size:
                        raise ArchiveRefused(f"member {m.name!r} is truncated")
                os.chmod(tmp, (m.mode & 0o755) | 0o600)
                os.utime(tmp, (m.mtime, m.mtime))
                os.replace(tmp, target)
            finally:
                if tmp.exists():
                    tmp.unlink()
            files += 1
            nbytes += m.size
    return files, nbytes, kept


class _HashingWriter:
    """A file opened for writing that hashes every byte written: the archive's digest without reading it back."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.sha = fh, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.fh.write(data)

    def tell(self) -> int:
        return self.fh.tell()


def build_archive(src: Path, out: Path, max_bytes: int, stop: Callable[[], bool] = lambda: False) -> Tuple[int, int, str]:
    """A tar of src's regular files and folders (links and special files left out), owner fields cleared,
    written to the new file `out` (never through a name that exists). Returns (files, bytes, sha256 of the
    archive); raises ArchiveRefused over the cap or when stopped."""
    files = nbytes = 0

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    fh = os.fdopen(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "wb")
    writer = _HashingWriter(fh)
    with fh, tarfile.open(fileobj=writer, mode="w:", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
            rel_dir = os.path.relpath(dirpath, src)
            if rel_dir != ".":
                tar.add(dirpath, arcname=rel_dir, recursive=False, filter=clean)
            for name in sorted(filenames):
                if stop():
                    raise ArchiveRefused("stopped")
                path = os.path.join(dirpath, name)
                if name.endswith(".part") or not os.path.isfile(path) or os.path.islink(path):
                    continue
                size = os.path.getsize(path)
                if nbytes + size > max_bytes:
                    raise ArchiveRefused(f"the caches hold more than the {max_bytes / (1 << 30):.1f} GiB cap "
                                         "(MXLAUNCH_KERNEL_CACHE_MAX_GIB)")
                tar.add(path, arcname=os.path.normpath(os.path.join(rel_dir, name)), recursive=False, filter=clean)
                files += 1
                nbytes += size
    return files, nbytes, writer.sha.hexdigest()
