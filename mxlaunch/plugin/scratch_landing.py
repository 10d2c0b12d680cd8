"""Non-contiguous GPU destinations take the pinned DMA path through a contiguous scratch tensor.

vLLM's online fp8 (`--quantization fp8`) keeps each quantized weight as a transposed view of its storage, so a
staged file's bytes (the view's row-major order) cannot be DMA'd into it: on the H200 those 4.25 GB went through
the pageable per-tensor `copy_` at 7 GB/s (weight phase 0.61 s against 0.09 s for a compressed-tensors FP8 model
of the same size). Here such a destination gets a contiguous scratch tensor of its shape on its own GPU; the
pinned path fills the scratch, and once every copy has completed `settle()` puts each scratch into place with one
device-side `copy_` (HBM speed) and frees it. The scratch is bounded (half the GPU's free memory when the first
one is taken): past that, destinations keep the pageable path, so a model that fills the GPU still loads.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _half_free(device: torch.device) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    return free // 2


class ScratchLanding:
    """Scratch tensors for one restore: `take` before the copies are queued, `settle` after they completed."""

    def __init__(self, budget: Optional[int] = None, measure: Callable[[torch.device], int] = _half_free) -> None:
        self.budget = budget
        self._measure = measure
        self.used = 0
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, dest: torch.Tensor) -> Optional[torch.Tensor]:
        """A contiguous tensor to land `dest`'s bytes in, or None (contiguous already, empty, or over budget)."""
        if dest.is_contiguous() or dest.numel() == 0:
            return None
        if self.budget is None:
            self.budget = self._measure(dest.device)
        size = dest.numel() * dest.element_size()
        if self.used + size > self.budget:
            return None
        scratch = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        self.used += size
        self.pairs.append((dest, scratch))
        return scratch

    def settle(self) -> int:
        """Put every scratch into its destination (call only once the copies into the scratch completed);
        returns the bytes moved. The scratch is released as it goes."""
        moved = 0
        devices = set()
        while self.pairs:
            dest, scratch = self.pairs.pop()
            dest.copy_(scratch)
            moved += scratch.numel() * scratch.element_size()
            devices.add(dest.device)
            del scratch
        for device in devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        self.used = 0
        return moved

    def drop(self) -> None:
        """A restore that failed: the scratch goes, nothing is put in place."""
        self.pairs.clear()
        self.used = 0
