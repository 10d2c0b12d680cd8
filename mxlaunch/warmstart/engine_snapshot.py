"""Engine snapshots: an initialized engine checkpointed once (GPU state by the CUDA driver, processes by CRIU),
restored on the node's next start with the same command instead of starting the engine at all.

Why: with the weights at 0.16 s, a vLLM start is the engine's own start-up (two interpreters, model build,
profile, KV cache, HTTP). A restored engine skips all of it: on the H200 (vLLM 0.26, the 8 GiB Llama, 17 GiB
of GPU memory) the probe restored one in 11.7–12.4 s against 38–77 s (docs/benchmarks.md), every answer exact.

This module holds the folder: its layout, finding a snapshot, the errors. The engine's process tree (what it
holds, the actions asked through its signal handler) is engine_tree.py's, taking one snapshot_take.py's (the
thread that takes it beside the serving engine: snapshot_maker.py), restoring one snapshot_restore.py's.

Layout (node-local: an image holds the engine's whole memory, its GPU memory included, tens of GiB):

    $MXLAUNCH_ENGINE_SNAPSHOTS (default ~/.cache/mxlaunch/engine-snapshots)/<uid>/   0700, this user's alone
        key-salt                    the salt of the key's digests (warmstart/snapshot_key.py), 0600
        <key>/                      one per command and environment (snapshot_key.py: argv, named files, source id,
                                    interpreter, kernel, cwd, every variable but the run-only ones)
            key.json                what the key digests: values of variables and secrets only as salted digests
            meta.json               pids, the GPU pids, the output pipe's inode, the files put back before a restore
            *.img                   CRIU's files
            link-remaps/            unlinked files CRIU kept by a link (POSIX semaphores): a restore consumes them
            shm-files/              /dev/shm files the engine had open (the launcher's cleanup removes them)

/dev/shm is every user's (docs/security.md): the post-dump step takes only link-remap files that are regular,
this user's and held by the dumped tree (warmstart/snapshot_files.py), the named files are read without following
a link, and a restore puts each file back only as a new name (O_EXCL | O_NOFOLLOW): a name another user took
first refuses the restore (one event; the engine starts as usual), nothing is written through it.
        .<key>.<pid>.tmp/           a snapshot in progress, renamed into place when complete

Taking one (snapshot_take.py `take`, once the first start is ready and its capture is published; the engine pauses for it):
vLLM started with --enable-sleep-mode is first put to sleep at level 1 (its weights to host memory, the KV
cache discarded: an idle engine's KV cache is garbage, and it was most of the image); then SIGUSR2 to every
engine process that installed mxlaunch's handler (plugin/snapshot_signal.py: NVML shut down), lock +
checkpoint every process with CUDA state, `criu dump --leave-running`, restore + unlock, wake up: the engine
serves on. Restoring (snapshot_restore.py `restore`): the files put back, `criu restore -d` with a new output pipe (--inherit-fd),
the GPU state restored and unlocked, the engine woken (a snapshot taken asleep); the launcher (a child
subreaper) becomes the restored tree's parent.

What it needs, checked before anything is tried: CRIU 4.2+ (4.1 fails on 6.16+ kernels' sockets), the
capability, the driver's checkpoint API where there is a GPU, and an engine started by the launcher with
io_uring filtered out (warmstart/no_io_uring.py). TCP connections are closed at restore (--tcp-close): clients
reconnect. Any failure is a `SnapshotError` or `CriuError`; the launcher then starts the engine as usual.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from mxlaunch import settings
from mxlaunch.warmstart.cuda_checkpoint import CudaCheckpoint
from mxlaunch.safety.ownership import ForeignPath, own_dir, private_dir

META = "meta.json"
SHM = Path("/dev/shm")
DUMP_FLAGS = ("--tcp-close", "--ext-unix-sk", "--file-locks", "--link-remap", "--ghost-limit", str(1 << 30))


class SnapshotError(Exception):
    """Why no snapshot was taken or restored (one line)."""


class NotAsked(SnapshotError):
    """An engine action that could not even be asked for (no handler, no engine client): nothing changed."""


def snapshots_root(environ: Mapping[str, str] = os.environ) -> Path:
    base = settings.engine_snapshots(environ) or Path.home() / ".cache" / "mxlaunch" / "engine-snapshots"
    return base / str(os.getuid())


def own_root(environ: Mapping[str, str] = os.environ) -> Path:
    """snapshots_root(), made if missing and checked: a real folder of this uid's that nobody else can enter
    (ownership.own_dir, 0700), below folders nobody else can rename it in (safe_ancestors). ForeignPath (one
    line naming the path and the fix) otherwise: an image is code, restored as this user."""
    root = snapshots_root(environ)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ForeignPath(f"cannot make {root.parent}: {exc.strerror or exc}",
                          f"point {settings.ENGINE_SNAPSHOTS} at a folder of yours") from None
    safe_ancestors(root.parent)
    own_dir(root)
    if not private_dir(root):  # own_dir allows group read; an image holds the engine's memory, secrets included
        raise ForeignPath(f"{root} is open to others (mode {os.lstat(root).st_mode & 0o777:04o})",
                          f"chmod 700 {root}")
    return root


def safe_ancestors(path: Path) -> None:
    """ForeignPath unless every folder from `path` up to / belongs to this uid or root and is writable by nobody
    else, or sticky (as /tmp): otherwise another user could rename the snapshots folder away and put theirs
    in its place between the check and CRIU reading it."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        st = os.stat(folder)
        mode = st.st_mode & 0o7777
        if st.st_uid not in (0, os.getuid()):
            why = f"belongs to uid {st.st_uid}"
        elif mode & 0o022 and not mode & 0o1000:
            why = f"is writable by others without the sticky bit (mode {mode:04o})"
        else:
            continue
        raise ForeignPath(f"{folder} (above the engine snapshots) {why}: another user could swap the snapshots",
                          f"point {settings.ENGINE_SNAPSHOTS} at a folder only you can write")


def find(root: Path, key: str) -> Optional[Path]:
    """The published snapshot for `key` in a folder only this user controls, or None."""
    folder = root / key
    if not private_dir(root) or not (folder / META).is_file() or os.lstat(folder).st_uid != os.getuid():
        return None
    return folder


def cuda_or_none() -> Optional[CudaCheckpoint]:
    """The driver's API where there is a driver; None on a CPU engine's node."""
    try:
        return CudaCheckpoint()
    except OSError:
        return None
