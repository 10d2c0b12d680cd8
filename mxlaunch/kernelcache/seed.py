"""A first serve on a node where the engine already ran: the key's empty folder is seeded with copies of what the
engine would have found in its own default places, so the capture run does not build again what the node has (on
the H200 a first serve spent 20.8 s in vLLM's init engine against 2.7 s for the engine alone, warm).

Where those places are is each library's own rule (`library_places`), moved by the engine where its import points
the libraries elsewhere (the engine's `kernel_cache_redirect`: SGLang 0.5.2x puts them under $SGLANG_CACHE_DIR).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mxlaunch.kernelcache.caches import inductor_default_dir, not_own, own_state, sync_tree
from mxlaunch.kernelcache.ninja_rebase import rebase_tree

# (the engine's cache root variable, its default under $HOME, ((variable, sub-folder of that root), ...)): what
# the engine's import points at its root when it finds those variables unset ("" = the root itself)
Redirect = Tuple[str, str, Tuple[Tuple[str, str], ...]]


@dataclass(frozen=True)
class DefaultPlace:
    """Where a variable's library keeps its cache when the variable is unset: `folder`, found at `inside` under
    the folder the variable names, less the top-level folders in `skip` (not compiled code)."""

    folder: Path
    inside: str = ""
    skip: Tuple[str, ...] = ()


def autotune_place(vllm_root: Path, flashinfer_version: Optional[str]) -> Tuple[DefaultPlace, ...]:
    """vLLM's FlashInfer autotune results when VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR is unset:
    $VLLM_CACHE_ROOT/flashinfer_autotune_cache/<FlashInfer version>/<its arch folder>/<config hash>/ (vllm
    model_executor/warmup: the workspace folder's last two names); with the variable set, <config hash>/ right
    under it. Only this FlashInfer's folder, and only when it holds one arch folder: tuned tactics of another
    GPU would be used, not ignored (a home shared by nodes of two GPU kinds is not seeded)."""
    if not flashinfer_version:
        return ()
    base = vllm_root / "flashinfer_autotune_cache" / flashinfer_version
    try:
        arches = [d for d in base.iterdir() if d.is_dir() and not d.is_symlink()]
    except OSError:
        return ()
    return (DefaultPlace(arches[0]),) if len(arches) == 1 else ()


def inductor_triton_places(environ: Mapping[str, str]) -> Tuple[DefaultPlace, ...]:
    """Inductor's own Triton kernels (torch.compile'd ops: vLLM's sampler even with --enforce-eager). With
    TRITON_CACHE_DIR unset Inductor keeps them in <its cache>/triton/<device>/; with it set — and the launch sets it
    beside TORCHINDUCTOR_CACHE_DIR — it looks there alone (torch/_inductor/runtime/cache_dir_utils.triton_cache_dir).
    Seeded from ~/.triton/cache alone, a first serve built them again (session 31, an H100: block FP8's capture
    spent 20.5 s in vLLM's init engine against 2.9 s for the engine alone). One place per device folder."""
    root = inductor_default_dir(environ)
    base = root / "triton"
    try:  # in a shared $TMPDIR: the folders above each device's must be this user's own too (caches.not_own), or
        # another user who made one first could rearrange what is below it; a refused root is said by its own place
        if not_own(os.lstat(root), is_dir=True) or not_own(os.lstat(base), is_dir=True):
            return ()
        devices = sorted(d for d in base.iterdir() if d.is_dir() and not d.is_symlink())
    except OSError:
        return ()
    return tuple(DefaultPlace(d) for d in devices)


def library_places(environ: Mapping[str, str], flashinfer_version: Optional[str] = None) -> Dict[str, Tuple[DefaultPlace, ...]]:
    """Each variable's default place by its library's own rule; a variable not listed is not seeded."""
    home = Path(environ.get("HOME") or Path.home())
    xdg = Path(environ.get("XDG_CACHE_HOME") or home / ".cache")
    vllm_root = Path(environ.get("VLLM_CACHE_ROOT") or xdg / "vllm")
    return {
        # vllm/envs.py: $XDG_CACHE_HOME/vllm; DeepGEMM's JIT cache and FlashInfer's autotune results under it are
        # seeded on their own (below), into the folders their variables name
        "VLLM_CACHE_ROOT": (DefaultPlace(xdg / "vllm", skip=("deep_gemm", "flashinfer_autotune_cache")),),
        "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR": autotune_place(vllm_root, flashinfer_version),
        # vllm/utils/deep_gemm.py sets DG_JIT_CACHE_DIR to $VLLM_CACHE_ROOT/deep_gemm when it is unset (issue 40:
        # seeded under the vllm folder, where DeepGEMM, pointed at the key's deep_gemm folder, never looked)
        "DG_JIT_CACHE_DIR": (DefaultPlace(vllm_root / "deep_gemm"),),
        "SGLANG_DG_CACHE_DIR": (DefaultPlace(home / ".cache" / "deep_gemm"),),  # SGLang before 0.5.2x
        "TRITON_CACHE_DIR": (DefaultPlace(home / ".triton" / "cache"), *inductor_triton_places(environ)),  # triton/knobs.py
        # its precompiled headers are read from this fixed place whatever the variable says (caches.side_dirs); its
        # Triton kernels are seeded into the launch's TRITON_CACHE_DIR, where Inductor then looks (above)
        "TORCHINDUCTOR_CACHE_DIR": (DefaultPlace(inductor_default_dir(environ), skip=("precompiled_headers", "triton")),),
        # flashinfer/jit/env.py: $FLASHINFER_WORKSPACE_BASE (default ~)/.cache/flashinfer; its downloaded cubins
        # stay in place (caches.KEPT_IN_PLACE)
        "FLASHINFER_WORKSPACE_BASE": (DefaultPlace(home / ".cache" / "flashinfer", ".cache/flashinfer", ("cubins",)),),
        "TILELANG_CACHE_DIR": (DefaultPlace(home / ".tilelang" / "cache"),),  # tilelang/env.py
        "TVM_FFI_CACHE_DIR": (DefaultPlace(home / ".cache" / "tvm-ffi"),),
        "CUDA_CACHE_PATH": (DefaultPlace(home / ".nv" / "ComputeCache"),),  # the driver's PTX JIT cache
    }


def default_places(environ: Mapping[str, str] = os.environ, redirect: Optional[Redirect] = None,
                   flashinfer_version: Optional[str] = None) -> Dict[str, Tuple[DefaultPlace, ...]]:
    """Where an engine's run finds each cache when its variable is unset, newest first: the place the engine's
    import moves it to (`redirect`), then the library's own (where an earlier release of the engine left it);
    and the engine's root itself, less the folders seeded on their own."""
    places = library_places(environ, flashinfer_version)
    if redirect is None:
        return places
    root_var, root_default, moved = redirect
    home = Path(environ.get("HOME") or Path.home())
    given = environ.get(root_var)
    if given and (given == "~" or given.startswith("~/")):
        given = str(home) + given[1:]
    root = Path(given) if given else home / root_default
    tops = []
    for var, sub in moved:
        library = places.get(var, ())
        inside, skip = (library[0].inside, library[0].skip) if library else ("", ())
        base = root / sub if sub else root
        places[var] = (DefaultPlace(base / inside if inside else base, inside, skip), *library)
        tops.append((Path(sub) / inside).parts[0] if (sub or inside) else "")
    places[root_var] = (DefaultPlace(root, skip=tuple(t for t in tops if t)),)
    return places


def seed_from_defaults(env: Mapping[str, str], folder: Path, max_bytes: int,
                       environ: Mapping[str, str] = os.environ, redirect: Optional[Redirect] = None,
                       flashinfer_version: Optional[str] = None) -> Tuple[int, int, str, int]:
    """Copy what the engine would find in its default places into the key's empty folder (`env`: the variables
    the launch sets, each to a sub-folder of `folder`). Copies, never links. Nothing when the default places hold
    more than max_bytes (the archive's cap). Only this user's own files in folders nobody else can write
    (caches.not_own): a default place in a shared /tmp that another user created first, or anything another user
    put into one, is left out and said. Returns (files, bytes, reason, ninja-built modules moved with them)."""
    places = default_places(environ, redirect, flashinfer_version)
    plan: List[Tuple[Path, Path, Sequence[str]]] = []
    total, refused = 0, []
    for var, target in env.items():
        if not Path(target).is_relative_to(folder):
            continue
        for place in places.get(var, ()):
            if not os.path.lexists(place.folder):
                continue
            state, why = own_state(place.folder)
            if why:
                refused.append(why)
                continue
            total += sum(size for rel, (size, _) in state.items() if rel.split(os.sep)[0] not in place.skip)
            plan.append((place.folder, Path(target) / place.inside, place.skip))
    left_out = f"; not seeded from {'; '.join(refused)}" if refused else ""
    if not plan:
        return 0, 0, f"the engine's default cache folders are empty here{left_out}", 0
    if total > max_bytes:
        return 0, 0, f"the default cache folders hold {total} bytes, more than the archive's cap {max_bytes}: not seeded", 0
    files = sum(sync_tree(src, dst, skip=skip, own=True) for src, dst, skip in plan)
    # ninja-built modules (FlashInfer's) name their outputs by absolute path: moved, or ninja builds them again
    ninja = shutil.which("ninja", path=environ.get("PATH"))
    moved = sum(rebase_tree(dst, src, dst, ninja) for src, dst, _ in plan)
    built = f"; {moved} ninja-built module(s) moved with them" if moved else ""
    return files, total, f"seeded {files} files from this node's default cache folders{built}{left_out}", moved
