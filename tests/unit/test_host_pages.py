"""Host destinations prepared before a CPU restore (plugin/host_pages.py): pages filled, no byte changed,
the same restored bytes whatever the setting (populate, huge, off)."""

from __future__ import annotations

import mmap
from pathlib import Path

import psutil
import pytest
import torch

from mxlaunch import settings
from mxlaunch.plugin import host_pages
from mxlaunch.plugin.capture import capture_tensors
from mxlaunch.plugin.loader import restore_tensors

pytestmark = pytest.mark.unit
MiB = 1 << 20


def test_populate_fills_the_page_tables_of_untouched_memory() -> None:
    size = 64 * MiB
    buf = mmap.mmap(-1, size)  # anonymous: no page until touched
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    before = psutil.Process().memory_info().rss
    assert host_pages.populate(addr, size)
    grown = psutil.Process().memory_info().rss - before
    assert grown >= size * 0.9, f"populate made only {grown / MiB:.1f} MiB resident"
    del addr
    buf.close()


def test_neither_call_changes_a_byte() -> None:
    t = torch.randint(0, 255, (9 * MiB + 123,), dtype=torch.uint8)
    copy = t.clone()
    host_pages.ask_huge(t.data_ptr(), t.numel())
    host_pages.populate(t.data_ptr() + 5, t.numel() - 5)  # an unaligned start is rounded down to its page
    assert torch.equal(t, copy)


def test_huge_pages_are_asked_for_the_aligned_interior_only() -> None:
    assert not host_pages.ask_huge(4096, (2 << 20) - 4096)  # no whole 2 MiB page inside: nothing asked


@pytest.mark.parametrize("value", ["populate", "huge", "0"])
def test_restore_gives_the_same_bytes_whatever_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           value: str) -> None:
    gen = torch.Generator().manual_seed(1)
    named = [("a", torch.randn(3 * MiB + 7, generator=gen)), ("b", torch.randn(17, 33, generator=gen).to(torch.bfloat16)),
             ("c", torch.randn(2 * MiB, generator=gen))]
    capture_tensors(named, tmp_path / "snap", fsync=False)
    monkeypatch.setenv(settings.RESTORE_HOST_PAGES, value)
    dests = [(n, torch.empty_like(t)) for n, t in named]
    restore_tensors(dests, sorted(str(p) for p in (tmp_path / "snap").glob("*.safetensors")), wait_timeout_s=5,
                    threads=2)
    for (_, want), (_, got) in zip(named, dests):
        assert torch.equal(want, got)


def test_the_setting_reads_three_values() -> None:
    assert settings.restore_host_pages({}) == "populate"
    assert settings.restore_host_pages({settings.RESTORE_HOST_PAGES: "0"}) == "0"
    assert settings.restore_host_pages({settings.RESTORE_HOST_PAGES: "huge"}) == "huge"
    assert settings.restore_host_pages({settings.RESTORE_HOST_PAGES: "yes"}) == "populate"
