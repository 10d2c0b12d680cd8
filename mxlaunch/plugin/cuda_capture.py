"""Device→host for capture: CUDA tensors reach the snapshot's files through pinned slots, several parts at once.

The first capture used a pageable `.to("cpu")` per tensor and one writing thread: 0.81 GiB/s from an
H200 into /dev/shm (docs/benchmarks.md), ~43 s added to the first start of a 35 GiB rank. Here each
writer owns two 16 MiB slots of one pinned buffer (`pinned.HostBuffer`): the copy of slice k+1 runs on
the writer's CUDA stream while slice k is written to the part file, and `writers` parts are written in
parallel (one file each: writes to one file serialise on its inode lock, on tmpfs as on most
filesystems). Nothing pinned outlives the capture.
"""

from __future__ import annotations

import contextlib
import os
import queue
from typing import BinaryIO, Iterator

import torch

from mxlaunch import settings
from mxlaunch.plugin import pinned
from mxlaunch.plugin.cuda_copier import CHUNK
from mxlaunch.plugin.snapshot_files import write_cpu_tensor
from mxlaunch.plugin.tensors import tensor_bytes


def capture_writers(parts: int) -> int:
    """MXLAUNCH_CAPTURE_WRITERS, else one per part up to 16 (and at most the cores): 16 beat 8 on the H200."""
    wanted = settings.capture_writers()
    if wanted:
        return min(wanted, parts)
    return max(1, min(16, parts, os.cpu_count() or 1))


class SlotWriter:
    """Writes tensors into an open file: CUDA ones through this writer's two pinned slots."""

    def __init__(self, slots: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> None:
        self.slots = slots
        self.views = [memoryview(s.numpy()) for s in slots]
        self.device = device
        self.stream: torch.cuda.Stream | None = None

    def write(self, fh: BinaryIO, tensor: torch.Tensor) -> int:
        t = tensor.detach()
        if t.device.type != "cuda":
            return write_cpu_tensor(fh, t)
        if self.stream is None:  # pool threads start on device 0: use the tensors' device
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(device=self.device)
        flat = tensor_bytes(t)
        n = flat.numel()
        pending: tuple[int, int, torch.cuda.Event] | None = None
        turn = 0
        with torch.cuda.stream(self.stream):
            for off in range(0, n, CHUNK):
                k = min(CHUNK, n - off)
                self.slots[turn][:k].copy_(flat[off:off + k], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                if pending is not None:
                    self._flush(fh, pending)
                pending = (turn, k, event)
                turn ^= 1
            if pending is not None:
                self._flush(fh, pending)
        return n

    def _flush(self, fh: BinaryIO, pending: tuple[int, int, torch.cuda.Event]) -> None:
        turn, k, event = pending
        event.synchronize()
        fh.write(self.views[turn][:k])


class PinnedCapture:
    """`writers` slot pairs in one pinned buffer; `writer()` lends a pair to one part's thread."""

    def __init__(self, device: torch.device, writers: int) -> None:
        self.device = device
        self.buffer = pinned.HostBuffer(writers * 2 * CHUNK)
        self._free: queue.Queue[SlotWriter] = queue.Queue()
        t = self.buffer.tensor
        for i in range(writers):
            pair = (t[2 * i * CHUNK:(2 * i + 1) * CHUNK], t[(2 * i + 1) * CHUNK:(2 * i + 2) * CHUNK])
            self._free.put(SlotWriter(pair, device))
        self.writers = writers

    @contextlib.contextmanager
    def writer(self) -> Iterator[SlotWriter]:
        w = self._free.get()
        try:
            yield w
        finally:
            self._free.put(w)

    def close(self) -> None:
        while not self._free.empty():  # streams hold no work past their last synchronize
            self._free.get_nowait()
        self.buffer.close()
