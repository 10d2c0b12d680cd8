"""Engine-neutral core of the in-engine plugin: capture a model's raw tensors, restore them from files.

Torch lives here (and in the engine adapters next to it), never in the launcher. Nothing in this module
knows vLLM or SGLang: an adapter hands it named tensors — a module's parameters and persistent buffers,
aliases included — and gets back files, byte counts and precise errors.

    targets = module_tensors(model)                      # [(name, tensor)], tied names included
    capture_tensors(targets, out_dir)                    # → part-00000.safetensors, ... (temp + rename)
    restore_tensors(targets, files, wait_timeout_s=600)  # wait for each file, copy in, check the fill

**Storage groups.** Names whose tensors are the same view of the same storage (tied weights: one
Parameter under two names, e.g. `lm_head.weight` and `model.embed_tokens.weight`) form one group. A group
is saved once, under its first name; the others are recorded in the file's metadata
(`mxlaunch.aliases`: {"first name": ["alias", ...]}) and are filled by that one copy. Restore checks that
every group of the target is filled exactly once, with the file's shape and dtype, that no file holds a
name the target lacks, and that aliases the snapshot recorded are tied in the target too.

**Files.** Plain safetensors (readable by `safetensors.safe_open`), written by this module so tensors
stream to disk without building a second copy in memory: an 8-byte header length, a JSON header padded
to 8 bytes, then each tensor's bytes in order. Parts hold at most `part_bytes` (a larger tensor gets a
part of its own); names are `part-%05d.safetensors`, deterministic for a given model. Each part is
written under a temp name (`.part-….tmp`), fsynced, then renamed — a reader never sees half a file.

**Restore** reads with `os.preadv` straight into a CPU destination's memory (one copy, measured 2.3×
faster than `safe_open` + `copy_` on tmpfs), from a few threads; any other destination (CUDA) gets
`dest.copy_(source)` from a read-only mmap of the file. Errors carry `landed`: False when no byte of any
destination was written yet — the caller may still fall back to another loader — True otherwise (the
model is partial: stop, never serve it).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

log = logging.getLogger("mxlaunch.plugin")

PART_BYTES = 1 << 30
PART_NAME = "part-{:05d}.safetensors"
ALIASES_KEY = "mxlaunch.aliases"
SCHEMA_KEY = "mxlaunch.schema"
MAX_HEADER = 100 << 20
COPY_SLICE = 64 << 20  # a big tensor is read in slices of this size, from several threads

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64"), ("float8_e8m0fnu", "F8_E8M0")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


# ---- errors ----------------------------------------------------------------------------------------


class RestoreError(RuntimeError):
    """Restoring failed. `landed`: whether any destination byte was already written."""

    def __init__(self, message: str, *, landed: bool = False) -> None:
        super().__init__(message)
        self.landed = landed


class SnapshotTimeout(RestoreError):
    """A file of the snapshot did not appear in time."""


class SnapshotCorrupt(RestoreError):
    """A file exists but is not a complete, well-formed safetensors file of the expected size."""


class LayoutMismatch(RestoreError):
    """The snapshot's tensors do not match the target's: unknown, missing, twice, shape or dtype."""


class CaptureError(RuntimeError):
    """Writing the snapshot failed (the partial files were removed)."""


# ---- targets: named tensors grouped by storage ---------------------------------------------------------


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of `module`, by every name it has (tied names included)."""
    out: list[tuple[str, torch.Tensor]] = [
        (name, param) for name, param in module.named_parameters(remove_duplicate=False)
    ]
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
        for buf_name, buf in mod._buffers.items():
            if buf is None or buf_name in non_persistent:
                continue
            out.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    # named_modules(remove_duplicate=False) can list one (module, buffer) pair under two paths: fine,
    # both names are aliases of one storage group. Drop exact (name, tensor) repeats only.
    seen: set[str] = set()
    unique = []
    for name, tensor in out:
        if name not in seen:
            seen.add(name)
            unique.append((name, tensor))
    return unique


def _view_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


@dataclass
class Group:
    """Names that share one tensor (same storage, offset, shape, stride, dtype); `name` is the first."""

    names: list[str]
    tensor: torch.Tensor

    @property
    def name(self) -> str:
        return self.names[0]


def group_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[Group]:
    """Group names by identical views, in first-appearance order. Meta tensors have no data: skipped."""
    groups: dict[tuple, Group] = {}
    names: set[str] = set()
    for name, tensor in named:
        if name in names:
            raise ValueError(f"tensor name {name!r} given twice")
        names.add(name)
        t = tensor.detach()
        if t.device.type == "meta":
            continue
        key = _view_key(t) if t.numel() else ("empty", name)  # zero-size tensors share no data
        group = groups.get(key)
        if group is None:
            groups[key] = Group([name], t)
        else:
            group.names.append(name)
    return list(groups.values())


# ---- capture -------------------------------------------------------------------------------------------


@dataclass
class CaptureResult:
    files: list[Path]
    bytes: int          # tensor bytes written (each storage group once)
    tensors: int        # groups written
    seconds: float


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, on CPU and contiguous (a copy only when it has to be)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _plan_parts(groups: list[Group], part_bytes: int) -> list[list[Group]]:
    parts: list[list[Group]] = [[]]
    size = 0
    for g in groups:
        n = g.tensor.numel() * g.tensor.element_size()
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(g)
        size += n
    return [p for p in parts if p] or [[]]


def _header(part: list[Group], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for g in part:
        t = g.tensor
        if t.dtype not in _DTYPES:
            raise CaptureError(f"tensor {g.name} has dtype {t.dtype}, which safetensors cannot hold")
        n = t.numel() * t.element_size()
        header[g.name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def capture_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike[str],
    *,
    part_bytes: int = PART_BYTES,
    fsync: bool = True,
    metadata: dict[str, str] | None = None,
) -> CaptureResult:
    """Write `named` tensors (each storage group once) as safetensors parts into `out_dir`.

    Each part appears by rename when complete. On any error the parts written so far and the temp file
    are removed and CaptureError is raised.
    """
    started = time.perf_counter()
    out = Path(out_dir)
    groups = group_tensors(named)
    aliases = {g.name: g.names[1:] for g in groups if len(g.names) > 1}
    meta = {"format": "pt", SCHEMA_KEY: "1", **(metadata or {})}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True, separators=(",", ":"))
    written: list[Path] = []
    tmp: Path | None = None
    total = 0
    try:
        out.mkdir(parents=True, exist_ok=True)
        for index, part in enumerate(_plan_parts(groups, part_bytes)):
            final = out / PART_NAME.format(index)
            tmp = out / f".{final.name}.{os.getpid()}.tmp"
            part_meta = dict(meta)
            if aliases:  # each part records the aliases of its own tensors only
                own = {g.name: g.names[1:] for g in part if len(g.names) > 1}
                part_meta.pop(ALIASES_KEY)
                if own:
                    part_meta[ALIASES_KEY] = json.dumps(own, sort_keys=True, separators=(",", ":"))
            with open(tmp, "wb") as fh:
                fh.write(_header(part, part_meta))
                for g in part:
                    data = _tensor_bytes(g.tensor)
                    fh.write(data)
                    total += len(data)
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, final)
            tmp = None
            written.append(final)
        if fsync:
            _fsync_dir(out)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        for path in written:
            path.unlink(missing_ok=True)
        if isinstance(exc, (CaptureError, KeyboardInterrupt, SystemExit)):
            raise
        raise CaptureError(f"cannot write the snapshot into {out}: {exc}") from exc
    return CaptureResult(files=written, bytes=total, tensors=len(groups), seconds=time.perf_counter() - started)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- reading safetensors headers -------------------------------------------------------------------------


@dataclass
class FileEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass
class FileHeader:
    path: Path
    size: int
    entries: list[FileEntry]
    aliases: dict[str, list[str]] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(e.end - e.begin for e in self.entries)


def read_header(path: str | os.PathLike[str], expected_size: int | None = None) -> FileHeader:
    """Parse and check a safetensors header against the file's size; SnapshotCorrupt when it is wrong."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if expected_size and size != expected_size:
                raise SnapshotCorrupt(f"{p} is {size} bytes, the snapshot says {expected_size}")
            head = fh.read(8)
            if len(head) < 8:
                raise SnapshotCorrupt(f"{p} is too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise SnapshotCorrupt(f"{p}: header length {n} does not fit the file ({size} bytes)")
            raw = fh.read(n)
    except OSError as exc:
        raise SnapshotCorrupt(f"cannot read {p}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotCorrupt(f"{p}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SnapshotCorrupt(f"{p}: the safetensors header is not a JSON object")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    entries: list[FileEntry] = []
    try:
        for name, spec in header.items():
            code = spec["dtype"]
            if code not in _CODES:
                raise SnapshotCorrupt(f"{p}: tensor {name} has unsupported dtype {code}")
            dtype = _CODES[code]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            if begin < 0 or end - begin != numel * dtype.itemsize or base + end > size:
                raise SnapshotCorrupt(f"{p}: tensor {name} has offsets [{begin}, {end}] that do not fit its "
                                      f"shape {list(shape)} {code} or the file ({size} bytes)")
            entries.append(FileEntry(name, dtype, shape, base + begin, base + end))
        aliases = json.loads(meta[ALIASES_KEY]) if ALIASES_KEY in meta else {}
        if not isinstance(aliases, dict):
            raise SnapshotCorrupt(f"{p}: metadata {ALIASES_KEY} is not a JSON object")
    except SnapshotCorrupt:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotCorrupt(f"{p}: malformed safetensors header ({exc!r})") from exc
    return FileHeader(p, size, entries, {str(k): [str(a) for a in v] for k, v in aliases.items()})


# ---- restore -------------------------------------------------------------------------------------------


@dataclass
class RestoreResult:
    bytes: int
    tensors: int
    files: int
    seconds: float       # from the call to the last byte in place (waits included)
    wait_seconds: float  # of which spent waiting for files to appear
    copy_bytes: int = 0  # bytes that went through dest.copy_() instead of preadv (CUDA, strided)


class _Fill:
    """Which storage groups of the target are filled; the checks that make restore exact."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.groups = group_tensors(named)
        self.by_name: dict[str, int] = {n: i for i, g in enumerate(self.groups) for n in g.names}
        self.filled: dict[int, str] = {}  # group index → file that filled it

    def check(self, header: FileHeader, *, landed: bool, pending: dict[int, str] | None = None) -> list[tuple[FileEntry, Group]]:
        """Every entry of the file names a known, not yet filled group with its shape and dtype."""
        plan: list[tuple[FileEntry, Group]] = []
        claimed = dict(self.filled) if pending is None else pending
        unknown = [e.name for e in header.entries if e.name not in self.by_name]
        if unknown:
            raise LayoutMismatch(
                f"{header.path} holds {len(unknown)} tensor(s) the model does not have: {_few(unknown)} "
                "(a snapshot of another model or layout)", landed=landed)
        for e in header.entries:
            index = self.by_name[e.name]
            group = self.groups[index]
            if index in claimed:
                other = claimed[index]
                raise LayoutMismatch(f"tensor {e.name} (storage of {group.name}) is filled twice: by {other} and "
                                     f"by {header.path}", landed=landed)
            t = group.tensor
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise LayoutMismatch(
                    f"tensor {e.name}: the snapshot has {list(e.shape)} {_DTYPES.get(e.dtype, e.dtype)}, the model "
                    f"{list(t.shape)} {_DTYPES.get(t.dtype, t.dtype)} ({header.path})", landed=landed)
            claimed[index] = str(header.path)
            plan.append((e, group))
        for first, others in header.aliases.items():
            for alias in others:
                if self.by_name.get(alias) != self.by_name.get(first):
                    raise LayoutMismatch(f"the snapshot ties {alias} to {first}, the model does not "
                                         f"({header.path})", landed=landed)
        return plan

    def mark(self, header: FileHeader) -> None:
        for e in header.entries:
            self.filled[self.by_name[e.name]] = str(header.path)

    def missing(self) -> list[str]:
        return [g.name for i, g in enumerate(self.groups) if i not in self.filled]


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", … ({len(names) - n} more)" if len(names) > n else "")


def wait_for_file(path: str | os.PathLike[str], timeout_s: float, *, landed: bool = False,
                  cancelled: Callable[[], bool] | None = None) -> float:
    """Poll until `path` exists (the stager renames complete files into place); seconds waited."""
    started = time.perf_counter()
    deadline = started + timeout_s
    delay = 0.002
    while not os.path.exists(path):
        now = time.perf_counter()
        if now >= deadline:
            raise SnapshotTimeout(f"{path} did not appear within {timeout_s:g} s (is the stager running? "
                                  "raise wait_timeout_s in the plan for slow storage)", landed=landed)
        if cancelled is not None and cancelled():
            raise RestoreError(f"cancelled while waiting for {path}", landed=landed)
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.05)
    return time.perf_counter() - started


def default_threads() -> int:
    env = os.environ.get("MXLAUNCH_RESTORE_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(8, os.cpu_count() or 1))


def _cpu_view(t: torch.Tensor) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor, or None when it must go through copy_()."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    try:
        return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError, ValueError):
        return None


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise SnapshotCorrupt(f"{path} ended early at byte {offset + done}")
        done += got


def _copy_file(header: FileHeader, plan: list[tuple[FileEntry, Group]], pool: ThreadPoolExecutor | None) -> int:
    """Copy the file's tensors into their groups; returns the bytes that went through copy_() (not preadv)."""
    copied = 0
    fd = os.open(header.path, os.O_RDONLY)
    mm: mmap.mmap | None = None
    try:
        jobs: list[tuple[memoryview, int]] = []
        for entry, group in plan:
            if entry.end == entry.begin:
                continue
            view = _cpu_view(group.tensor)
            if view is not None:
                for start in range(0, len(view), COPY_SLICE):
                    jobs.append((view[start:start + COPY_SLICE], entry.begin + start))
                continue
            if mm is None:
                mm = mmap.mmap(fd, header.size, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only mapping: torch warns, we only read from it
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(mm, dtype=torch.uint8, count=entry.end - entry.begin, offset=entry.begin)
            src = src.view(entry.dtype).view(entry.shape)
            group.tensor.copy_(src)  # CUDA or strided destinations: the engine's own device copy
            copied += entry.end - entry.begin
            del src
        if pool is None or len(jobs) < 2:
            for view, offset in jobs:
                _pread_into(fd, view, offset, header.path)
        else:
            for future in [pool.submit(_pread_into, fd, v, o, header.path) for v, o in jobs]:
                future.result()
        if mm is not None and any(g.tensor.device.type == "cuda" for _, g in plan):
            torch.cuda.synchronize()
        return copied
    finally:
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view still exported: closes when collected
                pass
        os.close(fd)


def restore_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    files: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], int]],
    *,
    wait_timeout_s: float = 600.0,
    threads: int | None = None,
    on_file: Callable[[FileHeader, float], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> RestoreResult:
    """Fill the `named` tensors from `files`, in order, waiting for each to appear.

    `files` are paths or (path, expected bytes) pairs (0 = size unknown). Before any byte lands, the
    headers of the files already present are checked together (names, shapes, dtypes, duplicates), so a
    snapshot of the wrong model fails with landed=False. Raises RestoreError (see the subclasses).
    """
    started = time.perf_counter()
    fill = _Fill(named)
    specs = [(Path(f[0]), int(f[1])) if isinstance(f, tuple) else (Path(f), 0) for f in files]
    if not specs:
        raise LayoutMismatch("the snapshot lists no files for this rank")
    headers: dict[int, FileHeader] = {}
    # Up-front: every file already in place (at least the first, waited for) is checked before a byte lands.
    waited = wait_for_file(specs[0][0], wait_timeout_s, cancelled=cancelled)
    pending: dict[int, str] = {}
    for i, (path, size) in enumerate(specs):
        if i and not path.exists():
            continue
        headers[i] = read_header(path, size)
        fill.check(headers[i], landed=False, pending=pending)
    if len(headers) == len(specs):
        missing = [g.name for j, g in enumerate(fill.groups) if j not in pending]
        if missing:
            raise LayoutMismatch(f"the snapshot lacks {len(missing)} tensor(s) of the model: {_few(missing)}")
    landed = False
    nbytes = 0
    copy_bytes = 0
    n_threads = threads or default_threads()
    pool = ThreadPoolExecutor(n_threads, thread_name_prefix="mxlaunch-restore") if n_threads > 1 else None
    try:
        for i, (path, size) in enumerate(specs):
            if i not in headers:
                waited += wait_for_file(path, max(0.0, wait_timeout_s), landed=landed, cancelled=cancelled)
                headers[i] = read_header(path, size)
            header = headers[i]
            try:
                plan = fill.check(header, landed=landed)
            except RestoreError as exc:
                exc.landed = landed
                raise
            landed = landed or bool(plan)
            try:
                copy_bytes += _copy_file(header, plan, pool)
            except RestoreError as exc:
                exc.landed = True
                raise
            except (OSError, RuntimeError, ValueError) as exc:
                raise RestoreError(f"copying {path} into the model failed: {exc}", landed=True) from exc
            fill.mark(header)
            nbytes += header.bytes
            if on_file is not None:
                on_file(header, time.perf_counter() - started)
    except SnapshotCorrupt as exc:
        exc.landed = landed or exc.landed
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    missing = fill.missing()
    if missing:
        raise LayoutMismatch(f"the snapshot lacks {len(missing)} tensor(s) of the model: {_few(missing)}",
                             landed=landed)
    return RestoreResult(bytes=nbytes, tensors=len(fill.groups), files=len(specs),
                         seconds=time.perf_counter() - started, wait_seconds=waited, copy_bytes=copy_bytes)


__all__ = [
    "CaptureError", "CaptureResult", "FileHeader", "Group", "LayoutMismatch", "RestoreError", "RestoreResult",
    "SnapshotCorrupt", "SnapshotTimeout", "capture_tensors", "group_tensors", "module_tensors", "read_header",
    "restore_tensors", "wait_for_file",
]
