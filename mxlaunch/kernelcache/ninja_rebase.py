"""Ninja-built JIT modules copied to another folder, made current there without a rebuild.

Why: FlashInfer (and the other libraries that JIT-build with ninja) writes each module's build.ninja with its
outputs named by absolute path, and ninja rebuilds an output whose command it cannot find in .ninja_log (keyed
by that path, with a hash of the command) or whose deps it cannot find in .ninja_deps. Seeding a key's folder
with the node's default caches (kernelcache/seed.py) copies those trees to a new path, so every seeded module
was rebuilt: on an H100, SGLang's first serve through mxlaunch spent ~30 s rebuilding the FlashInfer norm module
that the engine alone had built minutes before (docs/benchmarks.md, session 29).

After the copy each build.ninja naming the old folder is rewritten to the new one, and its records move with it:
the log's command hashes are recomputed with ninja's own hash (log v5/v6: MurmurHash64A, v7: rapidhash) over
the commands ninja itself evaluates (`ninja -t compdb`), and the deps records get the copied outputs' mtimes.
What is not understood (another log or deps version, no ninja, an output without a command) is left as it was
copied: ninja then rebuilds, as it always did. Only files inside the key's folder are written, each through a
temp file and a rename.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

_MASK = (1 << 64) - 1
BUILD_FILE, LOG_FILE, DEPS_FILE = "build.ninja", ".ninja_log", ".ninja_deps"
DEPS_MAGIC, DEPS_VERSION = b"# ninjadeps\n", 4
COMPDB_TIMEOUT_S = 20


def murmur64a(data: bytes) -> int:
    """ninja's BuildLog hash before log v7 (MurmurHash64A, ninja's seed)."""
    m, r = 0xC6A4A7935BD1E995, 47
    h = (0xDECAFBADDECAFBAD ^ (len(data) * m)) & _MASK
    whole = len(data) // 8 * 8
    for i in range(0, whole, 8):
        k = (int.from_bytes(data[i:i + 8], "little") * m) & _MASK
        k = ((k ^ (k >> r)) * m) & _MASK
        h = ((h ^ k) * m) & _MASK
    if len(data) > whole:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * m) & _MASK
    h = ((h ^ (h >> r)) * m) & _MASK
    return h ^ (h >> r)


_RAPID_SECRET = (0x2D358DCCAA6C78A5, 0x8BB84B93962EACC9, 0x4B33A62ED433D4A3)


def _mum(a: int, b: int) -> Tuple[int, int]:
    product = a * b
    return product & _MASK, product >> 64


def _mix(a: int, b: int) -> int:
    lo, hi = _mum(a, b)
    return lo ^ hi


def rapidhash(data: bytes, seed: int = 0xBDD89AA982704029) -> int:
    """ninja's BuildLog hash from log v7 on (rapidhash, its default seed and secrets)."""
    s, n = _RAPID_SECRET, len(data)
    r64 = lambda o: int.from_bytes(data[o:o + 8], "little")  # noqa: E731
    r32 = lambda o: int.from_bytes(data[o:o + 4], "little")  # noqa: E731
    seed ^= _mix(seed ^ s[0], s[1]) ^ n
    if n <= 16:
        if n >= 4:
            last, delta = n - 4, (n & 24) >> (n >> 3)
            a, b = (r32(0) << 32) | r32(last), (r32(delta) << 32) | r32(last - delta)
        elif n > 0:
            a, b = (data[0] << 56) | (data[n >> 1] << 32) | data[n - 1], 0
        else:
            a = b = 0
    else:
        i, o = n, 0
        if i > 48:
            see1 = see2 = seed
            while i >= 48:
                for _ in range(2 if i >= 96 else 1):
                    seed = _mix(r64(o) ^ s[0], r64(o + 8) ^ seed)
                    see1 = _mix(r64(o + 16) ^ s[1], r64(o + 24) ^ see1)
                    see2 = _mix(r64(o + 32) ^ s[2], r64(o + 40) ^ see2)
                    o, i = o + 48, i - 48
            seed ^= see1 ^ see2
        if i > 16:
            seed = _mix(r64(o) ^ s[2], r64(o + 8) ^ seed ^ s[1])
            if i > 32:
                seed = _mix(r64(o + 16) ^ s[2], r64(o + 24) ^ seed)
        a, b = r64(o + i - 16), r64(o + i - 8)
    a, b = _mum(a ^ s[1], b ^ seed)
    return _mix(a ^ s[0] ^ n, b ^ s[1])


LOG_HASHES: Dict[int, Callable[[bytes], int]] = {5: murmur64a, 6: murmur64a, 7: rapidhash}


# ---- the files ------------------------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_log(path: Path) -> Tuple[int, List[List[str]]]:
    """(version, entries: [start, end, mtime, output, hash]); version 0 when it is not a log this reads."""
    lines = path.read_text(errors="replace").splitlines()
    if not lines or not lines[0].startswith("# ninja log v"):
        return 0, []
    try:
        version = int(lines[0][len("# ninja log v"):])
    except ValueError:
        return 0, []
    return version, [line.split("\t") for line in lines[1:] if line.count("\t") == 4]


def read_deps(data: bytes) -> Optional[Tuple[List[str], Dict[int, Tuple[int, List[int]]]]]:
    """(paths by id, output id → (mtime, input ids)) of a v4 .ninja_deps; None for anything else."""
    if not data.startswith(DEPS_MAGIC) or len(data) < 16 or struct.unpack_from("<I", data, 12)[0] != DEPS_VERSION:
        return None
    paths: List[str] = []
    deps: Dict[int, Tuple[int, List[int]]] = {}
    at = 16
    while at + 4 <= len(data):
        (head,) = struct.unpack_from("<I", data, at)
        size, is_deps = head & 0x7FFFFFFF, bool(head & 0x80000000)
        body = data[at + 4:at + 4 + size]
        if len(body) < size or size % 4:
            break  # a torn tail: ninja drops it too
        at += 4 + size
        if is_deps:
            out, mtime = struct.unpack_from("<iQ", body, 0)
            deps[out] = (mtime, list(struct.unpack_from(f"<{(size - 12) // 4}i", body, 12)))
        else:
            paths.append(body[:-4].rstrip(b"\0").decode("utf-8", "surrogateescape"))
    return paths, deps


def write_deps(paths: List[str], deps: Dict[int, Tuple[int, List[int]]]) -> bytes:
    out = [DEPS_MAGIC, struct.pack("<I", DEPS_VERSION)]
    for node_id, path in enumerate(paths):
        raw = path.encode("utf-8", "surrogateescape")
        raw += b"\0" * (-len(raw) % 4)
        out.append(struct.pack("<I", len(raw) + 4) + raw + struct.pack("<I", ~node_id & 0xFFFFFFFF))
    for node_id, (mtime, inputs) in deps.items():
        out.append(struct.pack("<IiQ", (12 + 4 * len(inputs)) | 0x80000000, node_id, mtime))
        out.append(struct.pack(f"<{len(inputs)}i", *inputs))
    return b"".join(out)


def _mtime_ns(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def compdb(ninja: str, folder: Path) -> Dict[str, str]:
    """Every edge's command as ninja evaluates it, by its (first) output; {} when ninja cannot say."""
    try:
        done = subprocess.run([ninja, "-f", BUILD_FILE, "-t", "compdb"], cwd=folder, capture_output=True, text=True,
                              timeout=COMPDB_TIMEOUT_S, check=False)
        rows = json.loads(done.stdout) if done.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return {row["output"]: row["command"] for row in rows if isinstance(row, dict) and "output" in row and "command" in row}


# ---- the move -------------------------------------------------------------------------------------------


def rebase_folder(folder: Path, old: str, new: str, ninja: Optional[str]) -> bool:
    """One build folder copied from `old` to `new` (absolute, resolved): its build.ninja, log and deps moved.
    True when its log was moved too (ninja will find its outputs current)."""
    old_p, new_p = old.rstrip("/") + "/", new.rstrip("/") + "/"
    build = folder / BUILD_FILE
    text = build.read_text(errors="surrogateescape")
    if old_p not in text:
        return False
    _write(build, text.replace(old_p, new_p).encode(errors="surrogateescape"))
    moved = lambda p: new_p + p[len(old_p):] if p.startswith(old_p) else p  # noqa: E731
    deps_file = folder / DEPS_FILE
    parsed = read_deps(deps_file.read_bytes()) if deps_file.is_file() else None
    if parsed is not None:
        paths, deps = parsed
        paths = [moved(p) for p in paths]
        for node_id, (mtime, inputs) in list(deps.items()):
            now = _mtime_ns(paths[node_id]) if 0 <= node_id < len(paths) else None
            deps[node_id] = (now if now is not None else mtime, inputs)
        _write(deps_file, write_deps(paths, deps))
    log_file = folder / LOG_FILE
    version, entries = read_log(log_file) if log_file.is_file() else (0, [])
    hash_of = LOG_HASHES.get(version)
    commands = compdb(ninja, folder) if ninja and hash_of else {}
    if not commands:
        return False
    kept = []
    for start, end, _mtime, output, digest in entries:
        output = moved(output)
        command, mtime = commands.get(output), _mtime_ns(output)
        if command is not None and mtime is not None:
            digest = format(hash_of(command.encode(errors="surrogateescape")), "x")
        kept.append("\t".join((start, end, str(mtime if mtime is not None else _mtime), output, digest)))
    _write(log_file, (f"# ninja log v{version}\n" + "".join(f"{line}\n" for line in kept)).encode(errors="surrogateescape"))
    return True


def rebase_tree(root: Path, old: Path, new: Path, ninja: Optional[str]) -> int:
    """Every build folder under `root` (a tree copied from `old` to `new`) moved; how many had their log moved."""
    old_s, new_s = os.path.realpath(old), os.path.realpath(new)
    if old_s == new_s:
        return 0
    moved = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        if BUILD_FILE in filenames and not os.path.islink(os.path.join(dirpath, BUILD_FILE)):
            try:
                moved += rebase_folder(Path(dirpath), old_s, new_s, ninja)
            except (OSError, UnicodeError, struct.error):
                continue  # left as copied: ninja rebuilds it
    return moved
