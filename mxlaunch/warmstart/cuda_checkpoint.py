"""The CUDA driver's process checkpoint API, called from the launcher on an engine's processes.

`cuCheckpointProcessLock/Checkpoint/Restore/Unlock` (driver 570+) move a process's whole GPU state into its
own host memory and back; NVIDIA's `cuda-checkpoint` tool is a thin wrapper over them, and it is not on most
nodes, so this calls the driver itself (ctypes; the launcher stays free of torch). cuInit opens the driver
here but makes no context. Measured on the H200 (2026-12-04, vLLM 0.26, 17 GiB of GPU memory): checkpoint
7.25 s, restore 2.6 s (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Iterable

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
STEPS = ("lock", "checkpoint", "restore", "unlock")


class CudaCheckpointError(Exception):
    """A checkpoint step the driver refused; the message names the step, the pid and the CUresult."""


class CudaCheckpoint:
    def __init__(self, load: Callable[[str], Any] = ctypes.CDLL) -> None:
        """Raises OSError without a CUDA driver, CudaCheckpointError when it lacks the API or cuInit fails."""
        self.lib = load("libcuda.so.1")
        if not hasattr(self.lib, "cuCheckpointProcessLock"):
            raise CudaCheckpointError("the CUDA driver has no checkpoint API — it needs driver 570 or newer")
        rc = self.lib.cuInit(0)
        if rc:
            raise CudaCheckpointError(f"cuInit returned CUresult {rc}")

    def state(self, pid: int) -> str | None:
        """The process's checkpoint state, or None when it has no CUDA state the driver knows of."""
        value = ctypes.c_int(-1)
        if self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(value)) != 0:
            return None
        return STATES.get(value.value, str(value.value))

    def with_cuda(self, pids: Iterable[int]) -> list[int]:
        return [p for p in pids if self.state(p) is not None]

    def step(self, name: str, pid: int, timeout_ms: int = 30000) -> float:
        """Run one step on `pid`; its seconds. Lock waits up to timeout_ms for the GPU work in flight."""
        fn = getattr(self.lib, f"cuCheckpointProcess{name.capitalize()}")
        args = (ctypes.c_uint32 * 16)()  # each step's args struct (≤ 64 bytes, reserved fields zero)
        if name == "lock":
            args[0] = timeout_ms
        t0 = time.perf_counter()
        rc = fn(pid, ctypes.byref(args))
        if rc != 0:
            raise CudaCheckpointError(f"cuCheckpointProcess{name.capitalize()}(pid {pid}) returned CUresult {rc}")
        return time.perf_counter() - t0

    def run(self, names: tuple[str, ...], pids: list[int]) -> float:
        """Each step on every pid in turn (all locked before any is checkpointed); the seconds taken."""
        t0 = time.perf_counter()
        for name in names:
            for pid in pids:
                self.step(name, pid)
        return time.perf_counter() - t0
