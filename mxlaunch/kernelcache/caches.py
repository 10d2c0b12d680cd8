"""JIT kernel caches, launcher side (no torch): where each engine keeps them, the cache key, the folders.

An engine compiles kernels at start-up (torch.compile/Inductor, Triton, FlashInfer, DeepGEMM, TVM-FFI,
vLLM's compile cache root) into folders its variables name; `Engine.kernel_cache_vars` lists them. mxlaunch
points every variable the user did not set at a sub-folder of one node-local folder per **key**, restores
that folder from the artifact store before the engine starts and captures it back once the server is ready
(store side: mxlaunch/kernelcache/archive.py; the launch side: mxlaunch/launch/kernel.py).

The key is sha256 over what decides whether compiled code can be reused: the source id (model, layout,
dtype, parallelism), the accelerator (GPU compute capability, or the CPU's ISA flags), the engine, torch,
Triton, CUDA and Python versions of the engine's interpreter (package metadata only), the flags the
engine says change compiled code (`Engine.kernel_cache_flags`), and the variables of its environment its own
compile cache hashes (`Engine.kernel_cache_env`: vLLM's VLLM_* ones). A key that covered less would restore an
archive the engine then ignores and rebuilds (inert); schema 2 added the environment. The fields are written next to the archive;
a cache is restored only when its stored fields hash to the key asked for.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mxlaunch import settings
from mxlaunch.safety import trust
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import engine_python, installed_versions
from mxlaunch.engines.registry import spec_engine

KEY_SCHEMA = 2  # bump when the key's fields change meaning: old archives stop matching
KEY_HEX = 24
# The libraries whose versions decide whether compiled code is reusable (first installed distribution wins).
VERSION_DISTS: Dict[str, Tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm"),
    "cuda": ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime"),
    "flashinfer": ("flashinfer-python",),
    "deep_gemm": ("deep-gemm", "deep_gemm"),
}
_ISA = re.compile(r"^(avx|amx|sse|ssse|fma|f16c|bmi|vnni|popcnt|aes|sve|asimd|fp16|bf16|i8mm|neon)|^sme\d*$")


# ---- the key ----------------------------------------------------------------------------------------------


def cpu_isa(cpuinfo: str | None = None) -> List[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo ("flags" on x86, "Features" on Arm)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if _ISA.match(f)})
    return []


def gpu_compute_capabilities() -> List[str]:
    """The node's GPU compute capabilities ("9.0") from nvidia-smi (no torch); [] when it cannot tell."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({x.strip() for x in r.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", x.strip())}) if r.returncode == 0 else []


def accelerator(device_type: str) -> Dict[str, Any]:
    """What compiled code is specific to: the GPUs' compute capability, or the CPU's ISA flags."""
    if device_type == "cuda":
        return {"device": "cuda", "compute_capability": gpu_compute_capabilities() or None}
    return {"device": device_type, "machine": platform.machine(), "isa": cpu_isa()}


def flags_digest(flags: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(flags).encode()).hexdigest()[:16]


def key_fields(spec: LaunchSpec, *, source_id: str, device_type: str, argv: Sequence[str],
               versions: Optional[Dict[str, Optional[str]]] = None, accel: Optional[Dict[str, Any]] = None,
               environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """The fields the key is made of (JSON-ready). `versions`/`accel` default to this node's; `environ` is the
    environment the engine starts in (the variables its own compile cache hashes are part of the key)."""
    engine = spec_engine(spec)
    flags = engine.kernel_cache_flags(list(argv))
    if versions is None:
        versions = installed_versions(VERSION_DISTS, engine_python(list(argv)))
    return {
        "schema": KEY_SCHEMA,
        "source_id": source_id,
        "engine": engine.name,
        "engine_version": spec.engine_version,
        "versions": dict(sorted(versions.items())),
        "accelerator": accel if accel is not None else accelerator(device_type),
        "flags": {"dtype": spec.dtype, "quantization": spec.quantization, "tp": spec.tp, "pp": spec.pp,
                  "dp": spec.dp, "ep": spec.ep, "argv": flags},
        "flags_digest": flags_digest({"dtype": spec.dtype, "quantization": spec.quantization, "tp": spec.tp,
                                      "pp": spec.pp, "dp": spec.dp, "ep": spec.ep, "argv": flags}),
        "env": engine.kernel_cache_env(environ),
    }


def cache_key(fields: Mapping[str, Any]) -> str:
    """sha256 over the canonical JSON of the fields → KEY_HEX hex digits (a safe path component)."""
    return hashlib.sha256(_canonical(fields).encode()).hexdigest()[:KEY_HEX]


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


# ---- the folders and variables --------------------------------------------------------------------------


def local_dir(key: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The node-local folder a key's caches live in, never /dev/shm (often noexec). It may differ between nodes:
    the caches are found by content hash, and ninja's records are moved on restore (ninja_rebase.py)."""
    return settings.kernel_cache_dir(environ) / key


@dataclass
class CacheVars:
    """The variables mxlaunch sets for the engine, and the ones the user set (then mxlaunch leaves them)."""

    env: Dict[str, str] = field(default_factory=dict)
    unmanaged: List[str] = field(default_factory=list)


# Moving a variable's folder moves more than compiled code under it: these stay where the engine keeps them by
# default. FlashInfer's base folder also holds the cubins it downloads (not compiled here; an offline node may
# have them only there).
KEPT_IN_PLACE: Dict[str, Tuple[str, str]] = {"FLASHINFER_WORKSPACE_BASE": ("FLASHINFER_CUBIN_DIR", "~/.cache/flashinfer/cubins")}


def cache_vars(var_dirs: Sequence[Tuple[str, str]], folder: Path, environ: Mapping[str, str] = os.environ) -> CacheVars:
    """Each (variable, sub-folder) → folder/sub-folder, unless the user's environment sets the variable; what
    KEPT_IN_PLACE names keeps its default place (unless set)."""
    out = CacheVars()
    for var, sub in var_dirs:
        if environ.get(var):
            out.unmanaged.append(var)
            continue
        out.env[var] = str(folder / sub)
        kept = KEPT_IN_PLACE.get(var)
        if kept and not environ.get(kept[0]):
            home = environ.get("HOME") or str(Path.home())
            out.env[kept[0]] = kept[1].replace("~", home, 1)
    return out


# ---- what changed in a folder ---------------------------------------------------------------------------

FolderState = Dict[str, Tuple[int, int]]  # relative path → (size, mtime_ns), regular files only


def folder_state(root: Path) -> FolderState:
    """Every regular file under root (links and special files are not followed or listed)."""
    state: FolderState = {}
    if not root.is_dir():
        return state
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_mode & 0o170000 == 0o100000:
                state[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return state


def changed(before: FolderState, after: FolderState) -> List[str]:
    """Files new or changed since `before`."""
    return sorted(p for p, v in after.items() if before.get(p) != v)


# ---- where the engine's caches are when mxlaunch does not move them (seeding: kernelcache/seed.py) ---------


def inductor_default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$TMPDIR/torchinductor_<user>: Inductor's cache when TORCHINDUCTOR_CACHE_DIR is unset, and where its
    precompiled headers always live (torch/_inductor: the user name with path-unsafe characters replaced)."""
    tmp = environ.get("TMPDIR") or tempfile.gettempdir()
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):
        user = f"uid_{os.getuid()}"
    return Path(tmp) / f"torchinductor_{re.sub(r'[/:*?<>|]', '_', user)}"



# ---- only this user's own files from shared places --------------------------------------------------------


def not_own(st: os.stat_result, *, is_dir: bool) -> Optional[str]:
    """Why a file or folder is not this user's own to take (None when it is): a link or other kind, another
    owner, or writable by others — by the group only when that group is not this user's private group."""
    kind_ok = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"is not a {'real folder' if is_dir else 'regular file'} (a link or another kind of file)"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not this user (uid {os.getuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 or (mode & 0o020 and not trust.private_group(st.st_gid)):
        return f"is writable by other users (mode {mode:04o})"
    return None


def own_state(root: Path) -> Tuple[FolderState, str]:
    """folder_state of this user's own files under root (`not_own`: another user's file or folder, or one others
    could write, is left out with what is below it); ({}, why) when root itself is not this user's own."""
    try:
        why = not_own(os.lstat(root), is_dir=True)
    except OSError as exc:
        return {}, f"{root} ({exc.strerror or exc})"
    if why:
        return {}, f"{root}, which {why}"
    state: FolderState = {}
    for dirpath, dirnames, filenames in os.walk(root):
        kept = []
        for d in dirnames:
            try:
                if not not_own(os.lstat(os.path.join(dirpath, d)), is_dir=True):
                    kept.append(d)
            except OSError:
                continue
        dirnames[:] = kept
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not not_own(st, is_dir=False):
                state[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return state, ""


def _copy_own(src: Path, tmp: Path) -> bool:
    """Copy one of this user's own files (opened without following a link, checked on its descriptor) to the new
    file tmp, mtime kept; False (nothing written) when it is not this user's own after all."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not_own(st, is_dir=False):
            return False
        os.set_blocking(fh.fileno(), True)
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         (stat.S_IMODE(st.st_mode) & 0o755) | 0o600)
        with os.fdopen(out_fd, "wb") as out:
            while chunk := fh.read(1 << 20):
                out.write(chunk)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    return True


# ---- caches outside the key's folder ------------------------------------------------------------------


def side_dirs(environ: Mapping[str, str] = os.environ) -> Dict[str, Path]:
    """sub-folder of the key's folder → a cache folder no variable moves, restored to / captured from there.

    Inductor's precompiled headers (CPU builds; a ~150 MB .gch that takes seconds to build) live in
    $TMPDIR/torchinductor_<user>/precompiled_headers whatever TORCHINDUCTOR_CACHE_DIR says
    (torch/_inductor/codecache.py `_HEADER_DIR`, fixed at import). Their names hash the header's content,
    the compile command and the compiler version, not the folder: they can be carried to another TMPDIR.
    In a shared /tmp another user may have made that folder first: then it is neither restored into nor
    captured from (empty dict; torch itself would still use it — the fix is a private TMPDIR)."""
    base = inductor_default_dir(environ)
    try:
        if not_own(os.lstat(base), is_dir=True):
            return {}
    except FileNotFoundError:
        pass
    except OSError:
        return {}
    return {"inductor_pch": base / "precompiled_headers"}


def sync_tree(src: Path, dst: Path, only: Optional[Sequence[str]] = None, skip: Sequence[str] = (),
              own: bool = False) -> int:
    """Regular files of src that dst lacks (or has at another size) → dst, each copied (mtime kept) and a
    rename (never half a file); links and lock folders are left out, and the top-level folders in `skip`.
    `only` limits it to those relative paths. own=True (src is a shared or default place): only this user's
    own files in folders nobody else can write (`own_state`). Returns how many were added."""
    added = 0
    if not os.path.isdir(src) or (own and os.path.islink(src)):
        return 0
    wanted = None if only is None else set(only)
    left_out = {"locks", *skip}
    for rel, (size, _) in (own_state(src)[0] if own else folder_state(src)).items():
        if rel.split(os.sep)[0] in left_out or (wanted is not None and rel not in wanted):
            continue
        target = dst / rel
        if target.is_file() and not target.is_symlink() and target.stat().st_size == size:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            # a copy, not a link: a rewrite in one place never changes the other
            if _copy_own(src / rel, tmp) if own else _copy(src / rel, tmp):
                os.replace(tmp, target)
                added += 1
        finally:
            tmp.unlink(missing_ok=True)
    return added


def _copy(src: Path, tmp: Path) -> bool:
    shutil.copy2(src, tmp)
    return True
