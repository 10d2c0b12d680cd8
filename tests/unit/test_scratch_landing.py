"""Non-contiguous destinations (vLLM's online fp8 keeps its weights as transposed views) land through a contiguous
scratch tensor that is put in place after the copies: the values end where a per-tensor copy_ would put them,
the scratch is bounded, and a failed restore puts nothing in place. On CPU tensors here (the class is the same
for CUDA ones; the pinned DMA into the scratch ran on the H200, docs/benchmarks.md)."""

from __future__ import annotations

import torch

from mxlaunch.plugin.scratch_landing import ScratchLanding


def _transposed(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(cols, rows, dtype=torch.float32).t()  # a [rows, cols] view of [cols, rows] storage


def test_a_transposed_view_gets_its_bytes_in_row_major_order_of_the_view() -> None:
    dest = _transposed(3, 5)
    landing = ScratchLanding(budget=1 << 20)
    scratch = landing.take(dest)
    assert scratch is not None and scratch.is_contiguous() and scratch.shape == dest.shape
    want = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    # what the DMA does: the file's bytes, in the view's row-major order, into the scratch's memory
    scratch.view(-1).copy_(want.view(-1))
    assert not torch.equal(dest, want)  # nothing in place before settle
    assert landing.settle() == 15 * 4
    assert torch.equal(dest, want)
    assert landing.pairs == [] and landing.used == 0


def test_contiguous_and_empty_destinations_take_no_scratch() -> None:
    landing = ScratchLanding(budget=1 << 20)
    assert landing.take(torch.zeros(4, 4)) is None
    assert landing.take(torch.zeros(0, 4).t()) is None
    assert landing.pairs == []


def test_the_scratch_is_bounded_and_what_does_not_fit_keeps_the_other_path() -> None:
    landing = ScratchLanding(budget=2 * 15 * 4)
    assert landing.take(_transposed(3, 5)) is not None
    assert landing.take(_transposed(3, 5)) is not None
    assert landing.take(_transposed(3, 5)) is None  # over the budget: the pageable copy_ takes it
    assert landing.used == 2 * 15 * 4


def test_the_budget_is_measured_once_on_the_first_destination() -> None:
    calls: list[torch.device] = []

    def measure(device: torch.device) -> int:
        calls.append(device)
        return 1 << 20

    landing = ScratchLanding(measure=measure)
    landing.take(_transposed(2, 2))
    landing.take(_transposed(2, 2))
    assert calls == [torch.device("cpu")] and landing.budget == 1 << 20


def test_a_failed_restore_puts_nothing_in_place() -> None:
    dest = _transposed(2, 3)
    landing = ScratchLanding(budget=1 << 20)
    landing.take(dest).fill_(7.0)
    landing.drop()
    assert landing.settle() == 0
    assert torch.equal(dest, torch.zeros(2, 3))
