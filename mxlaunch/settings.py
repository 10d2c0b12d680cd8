"""Every `MXLAUNCH_*` environment variable, read in one place and documented here.

Modules ask these functions instead of `os.environ`, so `VARIABLES` below is the complete list (the
README's table is made from it). Each function takes the environment as an argument where a caller
needs to decide for another environment (Slurm's helpers, tests); otherwise it reads `os.environ`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Optional

from mxlaunch.errors import UsageError

ARTIFACT_PATH = "MXLAUNCH_ARTIFACT_PATH"
PLAN = "MXLAUNCH_PLAN"
DEVICE = "MXLAUNCH_DEVICE"
GROUP = "MXLAUNCH_GROUP"
DIST_ADDR = "MXLAUNCH_DIST_ADDR"
DIST_PORT = "MXLAUNCH_DIST_PORT"
NO_THP = "MXLAUNCH_NO_THP"
RESTORE_THREADS = "MXLAUNCH_RESTORE_THREADS"
SGLANG_PYTHON = "MXLAUNCH_SGLANG_PYTHON"
GPU_COPY = "MXLAUNCH_GPU_COPY"
GPU_READERS = "MXLAUNCH_GPU_READERS"
GPU_CHUNK_MIB = "MXLAUNCH_GPU_CHUNK_MIB"
GPU_REGISTRARS = "MXLAUNCH_GPU_REGISTRARS"
GPU_REGISTER_MIB = "MXLAUNCH_GPU_REGISTER_MIB"
GPU_POPULATE = "MXLAUNCH_GPU_POPULATE"
CAPTURE_WRITERS = "MXLAUNCH_CAPTURE_WRITERS"
CAPTURE_HUGE = "MXLAUNCH_CAPTURE_HUGE"
CAPTURE_PREPARE = "MXLAUNCH_CAPTURE_PREPARE"
RESTORE_HOST_PAGES = "MXLAUNCH_RESTORE_HOST_PAGES"
KERNEL_CACHE_DIR = "MXLAUNCH_KERNEL_CACHE_DIR"
KERNEL_CACHE_MAX_GIB = "MXLAUNCH_KERNEL_CACHE_MAX_GIB"
REGISTRY = "MXLAUNCH_REGISTRY"
REDIS_PASSWORD = "MXLAUNCH_REDIS_PASSWORD"
REDIS_TRUSTED = "MXLAUNCH_REDIS_TRUSTED"
KILL_WAIT = "MXLAUNCH_KILL_WAIT"
CAPTURE_TIMEOUT = "MXLAUNCH_CAPTURE_TIMEOUT"
CAPTURE_VIA_SHM = "MXLAUNCH_CAPTURE_VIA_SHM"
NIXL_UCX_PARAMS = "MXLAUNCH_NIXL_UCX_PARAMS"
NIXL_PULL = "MXLAUNCH_NIXL_PULL"
NIXL_PROGRESS_THREAD = "MXLAUNCH_NIXL_PROGRESS_THREAD"
P2P_CUDA_IPC = "MXLAUNCH_CUDA_IPC"
CRIU = "MXLAUNCH_CRIU"
SNAPSHOT_DIR = "MXLAUNCH_SNAPSHOT_DIR"
ENGINE_SNAPSHOTS = "MXLAUNCH_ENGINE_SNAPSHOTS"
KEEP_STAGED = "MXLAUNCH_KEEP_STAGED"  # launch --keep-staged: staged files stay in /dev/shm (staging/kept.py)
SNAPSHOT_SLEEP = "MXLAUNCH_SNAPSHOT_SLEEP"
SNAPSHOT_READ_AHEAD = "MXLAUNCH_SNAPSHOT_READ_AHEAD"
TRUSTED_WRITERS = "MXLAUNCH_TRUSTED_WRITERS"
GPU_COPY_MODES = ("auto", "ring", "hybrid", "register", "pageable")

VARIABLES: dict[str, str] = {
    ARTIFACT_PATH: "artifact store root when --artifact-path is not given (default ~/.cache/mxlaunch/store)",
    PLAN: "set by `mxlaunch launch` for the engine: the plan file the in-engine plugin reads (never set it by hand)",
    DEVICE: "cpu | cuda: the device type in the source id, when the command's --device and the node do not say",
    GROUP: "a group (name or number) every store file and folder gets, with g+rw and g+s on folders",
    DIST_ADDR: "Slurm multi-node runs: the head's address as the other nodes reach it (default: the first node's name)",
    DIST_PORT: "Slurm multi-node runs: the rendezvous port (default: 21000 + job id mod 8000)",
    NO_THP: "set (to anything) to keep stage readers from asking for 2 MiB pages for their bounce buffers",
    RESTORE_THREADS: "copy threads per worker for a staged restore into CPU memory (default min(8, CPUs))",
    SGLANG_PYTHON: "tests only: the SGLang interpreter the e2e tests run (default .venv-sglang/bin/python)",
    GPU_COPY: "staged restore into GPU memory: auto (staged files registered while the model is built, a pinned "
              "ring for the rest; the default) | ring | hybrid | register | pageable (the old per-tensor copy)",
    GPU_READERS: "pinned-ring reader threads per GPU worker (default one per core, at most 16)",
    GPU_CHUNK_MIB: "pinned-ring slot size in MiB, a multiple of 2 (default 16; 2 slots per reader)",
    GPU_REGISTRARS: "hybrid/register modes: threads registering staged files inside the weight phase (default 1)",
    GPU_REGISTER_MIB: "hybrid/register modes: MiB one registration covers (default 128)",
    GPU_POPULATE: "1: fill page tables (MADV_POPULATE_READ) before registering (measured: no gain on an H200)",
    CAPTURE_WRITERS: "capture from a GPU: parts written at once through pinned slots (default min(16, parts, CPUs))",
    CAPTURE_HUGE: "1: lay captured parts in tmpfs out in 2 MiB pages first (measured slower on an H200; default off)",
    RESTORE_HOST_PAGES: "CPU destinations of a staged restore: populate (fill their page tables in one call "
                        "before reading; the default), huge (ask for 2 MiB pages first), 0 (neither)",
    CAPTURE_PREPARE: "0: do not lay a capture's parts out in tmpfs (and page-lock them) while the engine loads; the "
                     "parts are then written after loading (default 1: the capture is then the device-to-host copy)",
    KERNEL_CACHE_DIR: "node-local folder the JIT kernel caches are restored into, one sub-folder per key (default "
                      "~/.cache/mxlaunch/kernel-cache; use a node-local disk — the path may differ per node)",
    KERNEL_CACHE_MAX_GIB: "largest kernel cache archive captured or restored, in GiB (default 8)",
    CAPTURE_TIMEOUT: "a capture over several nodes: seconds the claim holder waits for the other nodes' parts after "
                     "its own, before it gives up and removes the capture (default 600)",
    CAPTURE_VIA_SHM: "auto (the default): a capture is written into this node's /dev/shm first and uploaded to the "
                     "store in the background when the store is not on tmpfs and /dev/shm has room for it; off: "
                     "write straight to the store",
    REGISTRY: "the P2P source registry when --registry is not given: file (the artifact store's .peers folder; "
              "the default), file:/dir, or redis://host:port/db",
    REDIS_PASSWORD: "the password of a redis:// P2P registry whose URL has none (keeps it out of argv and the plan file)",
    REDIS_TRUSTED: "1: allow a redis:// P2P registry without a password (only on a network no one else reaches; "
                   "by default such a URL is refused: whoever can connect could read and forge P2P records)",
    KILL_WAIT: "in a Slurm job: the scheduler's KillWait in seconds (SIGTERM to SIGKILL), which bounds how long the "
               "launcher takes to stop (default: read from `scontrol show config`; 30, Slurm's default, if that fails)",
    NIXL_UCX_PARAMS: "P2P: init parameters of NIXL's UCX backend, key=value items separated by commas (or ';'), e.g. "
                     "num_threads=2 (default num_threads=4,split_batch_size=1: one request split over 4 UCX workers, measured "
                     "fastest on 2×H200; set it empty for NIXL's own defaults) — docs/p2p.md",
    NIXL_PULL: "P2P: how a pull posts its READs, key=value items: prepped=1 (prepared descriptor lists), merge=0, "
               "chunk_mib=N, inflight=N, batch_mib=N (0: one request) (default chunk_mib=64,batch_mib=0; empty: 4 GiB "
               "requests, spans whole) — docs/p2p.md",
    P2P_CUDA_IPC: "0: same-host P2P pulls go over NIXL too and sources export no CUDA IPC handles (default 1)",
    NIXL_PROGRESS_THREAD: "P2P: 0 starts NIXL agents without their progress thread (default 1)",
    CRIU: "the CRIU 4+ binary for `launch --zygote` images and the doctor's CRIU rows, e.g. the kit's "
          "`.criu4-kit/run.sh` (scripts/kits/build_criu_kit.sh; default: `criu` on PATH)",
    SNAPSHOT_DIR: "set by the engine-snapshot path for the engine: where each engine process reports, on SIGUSR2, that "
                  "it released NVML for a CRIU dump (never set it by hand)",
    KEEP_STAGED: "1: `launch --keep-staged` — the staged files stay in /dev/shm (hard links) for the next launch of the "
                 "same snapshot on this node (`mxlaunch kept` lists and drops them)",
    ENGINE_SNAPSHOTS: "where `launch --engine-snapshot` keeps its snapshots (node-local; they hold the engine's memory, "
                      "GPU memory included; default ~/.cache/mxlaunch/engine-snapshots; its <uid> folder must be "
                      "this user's alone, below folders nobody else can write unless sticky)",
    SNAPSHOT_SLEEP: "1: `launch --engine-snapshot` on a CUDA node starts vLLM with --enable-sleep-mode and sleeps it at "
                    "level 1 while it is snapshotted, so the image holds no KV cache; 2 or lean: at level 2, so the "
                    "image holds no weights either and a restore refills them from the staged snapshot (a lean "
                    "snapshot; needs a local store). Default 0 (awake) — docs/launch.md",
    SNAPSHOT_READ_AHEAD: "0: a snapshot restore does not read ahead the file pages its processes had touched "
                         "(warmstart/working_set.py; default 1: read them ahead while the image stages)",
    TRUSTED_WRITERS: "users and %groups (names or numbers, separated by commas or spaces) whose code this user accepts "
                     "from the store: kernel-cache archives written by them are restored (default: you alone; root "
                     "always) — docs/security.md",
}


def criu(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """$MXLAUNCH_CRIU, or None when unset or empty."""
    return environ.get(CRIU) or None


def engine_snapshots(environ: Mapping[str, str] = os.environ) -> Optional[Path]:
    """$MXLAUNCH_ENGINE_SNAPSHOTS (user-expanded), or None when unset or empty."""
    text = environ.get(ENGINE_SNAPSHOTS)
    return Path(text).expanduser() if text else None


def snapshot_sleep(environ: Mapping[str, str] = os.environ) -> int:
    """How an engine snapshot of vLLM on a GPU sleeps the engine first ($MXLAUNCH_SNAPSHOT_SLEEP): 0 awake, 1 at
    level 1 (the KV cache left out), 2 or "lean" at level 2 (the weights left out too, refilled from the
    snapshot at a restore: warmstart/lean_snapshot.py). Anything else is 0. Opt-in until GPU runs have shown each
    restore and serve exactly."""
    value = environ.get(SNAPSHOT_SLEEP, "0").strip().lower()
    return {"1": 1, "2": 2, "lean": 2}.get(value, 0)


def snapshot_read_ahead(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a snapshot restore reads ahead its processes' file pages ($MXLAUNCH_SNAPSHOT_READ_AHEAD, default on)."""
    return environ.get(SNAPSHOT_READ_AHEAD, "1").strip().lower() not in ("0", "off", "false", "no")


def artifact_path(environ: Mapping[str, str] = os.environ) -> Optional[Path]:
    """$MXLAUNCH_ARTIFACT_PATH (user-expanded), or None when unset or empty."""
    text = environ.get(ARTIFACT_PATH)
    return Path(text).expanduser() if text else None


def plan_path(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The plan file the launcher handed the engine, or None outside `mxlaunch launch`."""
    return environ.get(PLAN) or None


def device(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """A forced device type ("cpu" or "cuda"); None when unset or anything else."""
    value = environ.get(DEVICE)
    return value if value in ("cpu", "cuda") else None


def trusted_writers(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The names in $MXLAUNCH_TRUSTED_WRITERS as given (users; `%name` a group), [] when unset: resolved, and a
    name that is no user or group refused, by mxlaunch/safety/trust.py."""
    return [w for w in re.split(r"[\s,]+", environ.get(TRUSTED_WRITERS, "")) if w]


def group(environ: Mapping[str, str] = os.environ) -> str:
    """The shared group's name or number as given ("" when unset)."""
    return environ.get(GROUP, "").strip()


def dist_addr(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    return environ.get(DIST_ADDR) or None


def dist_port(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The rendezvous port as text (checked by the Slurm helper, which names the fix), or None."""
    return environ.get(DIST_PORT) or None


def no_thp(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(NO_THP) is not None


def restore_threads(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """A positive thread count, or None (then the restore picks its own)."""
    text = environ.get(RESTORE_THREADS)
    return int(text) if text and text.isdigit() and int(text) > 0 else None


def sglang_python(default: Path, environ: Mapping[str, str] = os.environ) -> Path:
    text = environ.get(SGLANG_PYTHON)
    return Path(text) if text else default


def _int(environ: Mapping[str, str], name: str) -> Optional[int]:
    text = environ.get(name, "").strip()
    return int(text) if text.isdigit() else None


def gpu_copy(environ: Mapping[str, str] = os.environ) -> str:
    """The GPU restore mode; anything unknown is the default, auto."""
    mode = environ.get(GPU_COPY, "auto").strip().lower() or "auto"
    return mode if mode in GPU_COPY_MODES else "auto"


def gpu_readers(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    return _int(environ, GPU_READERS)


def gpu_chunk_mib(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    return _int(environ, GPU_CHUNK_MIB)


def gpu_registrars(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    return _int(environ, GPU_REGISTRARS)


def gpu_register_mib(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    return _int(environ, GPU_REGISTER_MIB)


def gpu_populate(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(GPU_POPULATE, "0").strip() == "1"


def capture_writers(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    value = _int(environ, CAPTURE_WRITERS)
    return value if value else None


def capture_huge(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(CAPTURE_HUGE, "0").strip() == "1"


def capture_prepare(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(CAPTURE_PREPARE, "1").strip() != "0"


def restore_host_pages(environ: Mapping[str, str] = os.environ) -> str:
    """"populate" (page tables filled first, the default), "huge" (2 MiB pages asked for, then populated) or
    "0" (off); anything else reads as the default."""
    text = environ.get(RESTORE_HOST_PAGES, "").strip()
    return text if text in ("0", "huge") else "populate"


def kernel_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$MXLAUNCH_KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/mxlaunch/kernel-cache, else ~/.cache/mxlaunch/kernel-cache."""
    text = environ.get(KERNEL_CACHE_DIR)
    if text:
        return Path(text).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mxlaunch" / "kernel-cache"


def kernel_cache_max_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The archive size cap in bytes (MXLAUNCH_KERNEL_CACHE_MAX_GIB, a positive number; default 8 GiB)."""
    try:
        gib = float(environ.get(KERNEL_CACHE_MAX_GIB, "") or 8)
    except ValueError:
        gib = 8.0
    return int((gib if gib > 0 else 8.0) * (1 << 30))


def registry(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """$MXLAUNCH_REGISTRY (a registry URL), or None when unset or empty."""
    text = environ.get(REGISTRY, "").strip()
    return text or None
def redis_password(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """$MXLAUNCH_REDIS_PASSWORD, or None when unset or empty."""
    return environ.get(REDIS_PASSWORD) or None


def redis_trusted(environ: Mapping[str, str] = os.environ) -> bool:
    """True only when $MXLAUNCH_REDIS_TRUSTED is 1: an unauthenticated Redis registry is allowed."""
    return environ.get(REDIS_TRUSTED, "").strip() == "1"


def kill_wait(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """$MXLAUNCH_KILL_WAIT as whole seconds ≥ 0, or None when unset or not a number."""
    text = environ.get(KILL_WAIT, "").strip()
    return int(text) if text.isdigit() else None


def capture_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """$MXLAUNCH_CAPTURE_TIMEOUT in seconds (a positive number; default 600)."""
    try:
        value = float(environ.get(CAPTURE_TIMEOUT, "") or 600)
    except ValueError:
        value = 600.0
    return value if value > 0 else 600.0


def capture_via_shm(environ: Mapping[str, str] = os.environ) -> str:
    """$MXLAUNCH_CAPTURE_VIA_SHM: "off" (also 0, no, false) or "auto" (the default, and anything else)."""
    value = environ.get(CAPTURE_VIA_SHM, "").strip().lower()
    return "off" if value in ("off", "0", "no", "false") else "auto"


# ---- NIXL (P2P) ------------------------------------------------------------------------------------------

# The UCX backend parameters NIXL 1.5.1 reads (src/plugins/ucx/ucx_backend.cpp, ucx_utils.cpp): a typo must
# not pass silently, since NIXL ignores keys it does not know.
NIXL_UCX_KEYS = {
    "num_workers": 1, "num_threads": 0, "split_batch_size": 1, "ucx_num_device_channels": 1,  # integers ≥ value
    "device_list": None, "ucx_devices": None, "ucx_error_handling_mode": None, "engine_config": None,
}
NIXL_PULL_KEYS = {"prepped": "bool", "merge": "bool", "chunk_mib": 0, "inflight": 1, "batch_mib": 0}
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


def key_values(name: str, text: str) -> dict[str, str]:
    """`key=value` items separated by commas, or by ';' when the text holds one (then a value may hold
    commas). Raises UsageError naming the variable and the bad item."""
    fix = (f"set {name} to key=value items separated by commas (or by ';' when a value holds commas), "
           "e.g. num_threads=4,split_batch_size=1")
    out: dict[str, str] = {}
    for item in text.split(";" if ";" in text else ","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not _KEY.match(key):
            raise UsageError(f"{name}: {item!r} is not a key=value item", fix)
        if not value:
            raise UsageError(f"{name}: {key} has no value", fix)
        if key in out:
            raise UsageError(f"{name}: {key} is given twice", fix)
        out[key] = value
    return out


def _checked_int(name: str, key: str, value: str, least: int) -> int:
    if not value.isdigit() or int(value) < least:
        raise UsageError(f"{name}: {key}={value} is not a whole number ≥ {least}", f"give {key} a number ≥ {least}")
    return int(value)


# Measured on the 2×H200 machine (docs/benchmarks.md, scripts/bench/bench_p2p.py --knob-sweep): NIXL's UCX thread
# pool splits one request over 4 UCX workers, i.e. 4 CUDA streams to the peer GPU (UCX's cuda_ipc puts every
# copy from one peer on one stream otherwise): 346 GiB/s, 0.95× a torch peer copy, against 180–216 with
# NIXL's defaults. Set either variable (even to "") to replace these.
NIXL_UCX_DEFAULT = "num_threads=4,split_batch_size=1"
NIXL_PULL_DEFAULT = "chunk_mib=64,batch_mib=0"


def nixl_ucx_params(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """$MXLAUNCH_NIXL_UCX_PARAMS as the string map NIXL's create_backend("UCX", ...) takes (NIXL_UCX_DEFAULT
    when unset; "" for NIXL's own defaults)."""
    params = key_values(NIXL_UCX_PARAMS, environ.get(NIXL_UCX_PARAMS, NIXL_UCX_DEFAULT))
    for key, value in params.items():
        if key not in NIXL_UCX_KEYS:
            raise UsageError(f"{NIXL_UCX_PARAMS}: unknown UCX backend parameter {key!r}",
                             f"use one of {', '.join(sorted(NIXL_UCX_KEYS))} (what NIXL 1.5.1's UCX backend reads)")
        least = NIXL_UCX_KEYS[key]
        if least is not None:
            _checked_int(NIXL_UCX_PARAMS, key, value, least)
        if key == "ucx_error_handling_mode" and value not in ("none", "peer"):
            raise UsageError(f"{NIXL_UCX_PARAMS}: ucx_error_handling_mode={value}", "use none or peer")
    return params


def nixl_pull(environ: Mapping[str, str] = os.environ) -> dict[str, int | bool]:
    """$MXLAUNCH_NIXL_PULL parsed (NIXL_PULL_DEFAULT when unset): only the keys given (prepped/merge as bools,
    the rest as ints)."""
    out: dict[str, int | bool] = {}
    for key, value in key_values(NIXL_PULL, environ.get(NIXL_PULL, NIXL_PULL_DEFAULT)).items():
        kind = NIXL_PULL_KEYS.get(key)
        if kind is None:
            raise UsageError(f"{NIXL_PULL}: unknown key {key!r}", f"use one of {', '.join(NIXL_PULL_KEYS)}")
        if kind == "bool":
            if value not in ("0", "1"):
                raise UsageError(f"{NIXL_PULL}: {key}={value}", f"give {key} 0 or 1")
            out[key] = value == "1"
        else:
            out[key] = _checked_int(NIXL_PULL, key, value, int(kind))
    return out


def nixl_progress_thread(environ: Mapping[str, str] = os.environ) -> bool:
    """False only when $MXLAUNCH_NIXL_PROGRESS_THREAD is 0."""
    return environ.get(NIXL_PROGRESS_THREAD, "1").strip() != "0"


def p2p_cuda_ipc(environ: Mapping[str, str] = os.environ) -> bool:
    """False only when $MXLAUNCH_CUDA_IPC is 0: then a same-host pull goes over NIXL too, and a source
    exports no IPC handles."""
    return environ.get(P2P_CUDA_IPC, "1").strip() != "0"
