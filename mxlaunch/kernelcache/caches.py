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
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mxlaunch import settings
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
    """The node-local folder a key's caches live in: the same absolute path on every launch (caches hold
    absolute paths), never /dev/shm (often noexec)."""
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


# ---- where the engine's caches are when mxlaunch does not move them -------------------------------------


@dataclass(frozen=True)
class DefaultPlace:
    """Where a variable's library keeps its cache when the variable is unset: `folder`, found at `inside` under
    the folder the variable names, less the top-level folders in `skip` (not compiled code)."""

    folder: Path
    inside: str = ""
    skip: Tuple[str, ...] = ()


def inductor_default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$TMPDIR/torchinductor_<user>: Inductor's cache when TORCHINDUCTOR_CACHE_DIR is unset, and where its
    precompiled headers always live (torch/_inductor: the user name with path-unsafe characters replaced)."""
    tmp = environ.get("TMPDIR") or tempfile.gettempdir()
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):
        user = f"uid_{os.getuid()}"
    return Path(tmp) / f"torchinductor_{re.sub(r'[/:*?<>|]', '_', user)}"


def default_places(environ: Mapping[str, str] = os.environ) -> Dict[str, DefaultPlace]:
    """The default places mxlaunch knows (each library's own rule); a variable not listed is not seeded."""
    home = Path(environ.get("HOME") or Path.home())
    xdg = Path(environ.get("XDG_CACHE_HOME") or home / ".cache")
    return {
        "VLLM_CACHE_ROOT": DefaultPlace(xdg / "vllm"),  # vllm/envs.py: $XDG_CACHE_HOME/vllm
        "TRITON_CACHE_DIR": DefaultPlace(home / ".triton" / "cache"),  # triton/knobs.py
        # its precompiled headers are read from this fixed place whatever the variable says (side_dirs)
        "TORCHINDUCTOR_CACHE_DIR": DefaultPlace(inductor_default_dir(environ), skip=("precompiled_headers",)),
        # flashinfer/jit/env.py: $FLASHINFER_WORKSPACE_BASE (default ~)/.cache/flashinfer; its downloaded cubins
        # stay in place (KEPT_IN_PLACE)
        "FLASHINFER_WORKSPACE_BASE": DefaultPlace(home / ".cache" / "flashinfer", ".cache/flashinfer", ("cubins",)),
        "TVM_FFI_CACHE_DIR": DefaultPlace(home / ".cache" / "tvm-ffi"),
        "CUDA_CACHE_PATH": DefaultPlace(home / ".nv" / "ComputeCache"),  # the driver's PTX JIT cache
    }


def seed_from_defaults(env: Mapping[str, str], folder: Path, max_bytes: int,
                       environ: Mapping[str, str] = os.environ) -> Tuple[int, int, str]:
    """A first serve on a node where the engine already ran: copy what the engine would find in its default
    places into the key's empty folder, so the capture run does not build again what the node has (on the
    H200 a first serve spent 20.8 s in init engine against 2.7 s for the engine alone, warm). Copies, never
    links. Nothing when the default places hold more than max_bytes (the archive's cap). Returns (files,
    bytes, reason)."""
    places = default_places(environ)
    plan: List[Tuple[Path, Path, Tuple[str, ...]]] = []
    total = 0
    for var, target in env.items():
        place = places.get(var)
        if place is None or not Path(target).is_relative_to(folder) or not place.folder.is_dir():
            continue
        state = folder_state(place.folder)
        total += sum(size for rel, (size, _) in state.items() if rel.split(os.sep)[0] not in place.skip)
        plan.append((place.folder, Path(target) / place.inside, place.skip))
    if not plan:
        return 0, 0, "the engine's default cache folders are empty here"
    if total > max_bytes:
        return 0, 0, f"the default cache folders hold {total} bytes, more than the archive's cap {max_bytes}: not seeded"
    files = sum(sync_tree(src, dst, skip=skip) for src, dst, skip in plan)
    return files, total, f"seeded {files} files from this node's default cache folders"


# ---- caches outside the key's folder ------------------------------------------------------------------


def side_dirs(environ: Mapping[str, str] = os.environ) -> Dict[str, Path]:
    """sub-folder of the key's folder → a cache folder no variable moves, restored to / captured from there.

    Inductor's precompiled headers (CPU builds; a ~150 MB .gch that takes seconds to build) live in
    $TMPDIR/torchinductor_<user>/precompiled_headers whatever TORCHINDUCTOR_CACHE_DIR says
    (torch/_inductor/codecache.py `_HEADER_DIR`, fixed at import). Their names hash the header's content,
    the compile command and the compiler version, not the folder: they can be carried to another TMPDIR."""
    return {"inductor_pch": inductor_default_dir(environ) / "precompiled_headers"}


def sync_tree(src: Path, dst: Path, only: Optional[Sequence[str]] = None, skip: Sequence[str] = ()) -> int:
    """Regular files of src that dst lacks (or has at another size) → dst, each copied (mtime kept) and a
    rename (never half a file); links and lock folders are left out, and the top-level folders in `skip`.
    `only` limits it to those relative paths. Returns how many were added."""
    added = 0
    if not src.is_dir():
        return 0
    wanted = None if only is None else set(only)
    left_out = {"locks", *skip}
    for rel, (size, _) in folder_state(src).items():
        if rel.split(os.sep)[0] in left_out or (wanted is not None and rel not in wanted):
            continue
        target = dst / rel
        if target.is_file() and not target.is_symlink() and target.stat().st_size == size:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            shutil.copy2(src / rel, tmp)  # a copy, not a link: a rewrite in one place never changes the other
            os.replace(tmp, target)
            added += 1
        finally:
            tmp.unlink(missing_ok=True)
    return added
