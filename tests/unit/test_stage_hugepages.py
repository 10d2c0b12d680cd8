"""2 MiB destination pages (memory/hugepages.py): byte-exact on every write mode and chunk cut, and
the pager stops collapsing when it costs more than it saves."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mxlaunch.staging import reader as reader_mod
from mxlaunch.memory.hugepages import HUGE, HugePager
from mxlaunch.staging.reader import WRITE_MODES, stage
from mxlaunch.staging.sources import expand_sources
from tests.helpers.stage_data import sha256_of, shm_dest, tree_of, write_pattern_file

MiB = 1 << 20
# Below, at and around 2 MiB blocks, plus a tail that is not a multiple of 4 KiB.
SIZES = [HUGE - 1, HUGE, 6 * MiB + 5, 20 * MiB + 4097]


dest = pytest.fixture(shm_dest, name="dest")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("hsrc")
    return {f"h{size}.bin": (root / f"h{size}.bin", write_pattern_file(root / f"h{size}.bin", size, seed=size % 97))
            for size in SIZES}


@pytest.fixture()
def always_collapse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pager that never gives up on cost (this VM's fresh memory is dear), so the path is exercised."""
    real = HugePager

    def forced(enabled: bool = True, **_: object) -> HugePager:
        return real(enabled=enabled, max_cpu_s_per_gib=1e9, probe_bytes=0)

    monkeypatch.setattr(reader_mod, "HugePager", forced)


@pytest.mark.parametrize("mode", WRITE_MODES)
@pytest.mark.parametrize("chunk", [3 * MiB, 16 * MiB])  # 3 MiB: chunks that start and end mid-block
def test_collapsed_destination_is_byte_exact(sources, dest, always_collapse, chunk: int, mode: str) -> None:
    items = expand_sources([str(p) for p, _ in sources.values()])
    result = stage(items, dest, readers=4, chunk_size=chunk, write_mode=mode)
    if result.huge_bytes == 0:
        pytest.skip(f"no 2 MiB pages here: {result.huge_note}")
    for name, (_, digest) in sources.items():
        assert sha256_of(dest / name) == digest, name
    assert tree_of(dest) == sorted(sources)


def test_disabled_huge_pages_collapse_nothing(sources, dest) -> None:
    items = expand_sources([str(p) for p, _ in sources.values()])
    result = stage(items, dest, readers=2, huge_pages=False)
    assert result.huge_bytes == 0
    for name, (_, digest) in sources.items():
        assert sha256_of(dest / name) == digest, name


def test_pager_stops_when_collapsing_costs_more_than_small_pages() -> None:
    pager = HugePager(max_cpu_s_per_gib=0.3, probe_bytes=32 * MiB)
    pager._record(16 * MiB, 0.001)  # cheap: 0.06 s/GiB
    pager._record(16 * MiB, 0.001)
    assert pager.enabled
    for _ in range(32):  # memory gets dear mid-job: 3 s/GiB
        pager._record(16 * MiB, 0.047)
    assert not pager.enabled
    assert "CPU s/GiB" in (pager.reason or "")


def test_pager_verdict_after_probe_when_dear_from_the_start() -> None:
    pager = HugePager(max_cpu_s_per_gib=0.3, probe_bytes=32 * MiB)
    pager._record(16 * MiB, 0.05)
    assert pager.enabled  # one chunk is not a verdict
    pager._record(16 * MiB, 0.05)
    assert not pager.enabled


def test_readers_wait_for_the_probe_instead_of_filling_small_pages(dest) -> None:
    """While one reader probes, another's prepare waits for the verdict and then collapses (it used to
    return at once and fill 4 KiB pages, whose contention was then measured into the probe)."""
    import os
    import threading

    from mxlaunch.memory.hugepages import FileMapping

    dest.mkdir(parents=True)
    fd = os.open(dest / "f", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8 * MiB)
    mapping = FileMapping(fd, 8 * MiB)
    pager = HugePager(max_cpu_s_per_gib=1e9, probe_bytes=4 * MiB)
    blocked = threading.Event()

    class Recorded(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            blocked.set()  # still holding the lock: the main thread's notify comes after this wait began
            return super().wait(timeout)

    pager._probe_done = Recorded(pager._lock)
    try:
        with pager._lock:
            pager._probing = True  # a probe in flight
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(pager.prepare(mapping, fd, 0, 4 * MiB)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not blocked.is_set() and waiter.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert blocked.is_set() and got == [], f"the reader did not wait for the probe's verdict: {got}"
        with pager._lock:
            pager._probing = False
            pager._probe_done.notify_all()
        waiter.join(60)
        assert not waiter.is_alive(), "the verdict did not wake the waiting reader"
        if pager.reason and "MADV_COLLAPSE failed" in pager.reason:
            pytest.skip(f"no 2 MiB pages here: {pager.reason}")
        assert got == [True]
        assert pager.collapsed == 4 * MiB
        assert not pager._probing  # the waiter's own probe chunk released the next one
    finally:
        mapping.close()
        os.close(fd)


def test_non_tmpfs_destination_does_not_collapse(sources, tmp_path: Path) -> None:
    items = expand_sources([str(p) for p, _ in sources.values()])
    result = stage(items, tmp_path / "out", readers=2)
    assert result.huge_bytes == 0
    assert result.huge_note == "the destination is not tmpfs"


def test_the_pagers_average_forgets_what_lies_beyond_its_window() -> None:
    """Memory that gets dear after a long cheap run stops the collapses within a window's bytes: the average
    weighs the last `window` bytes, not the whole job."""
    pager = HugePager(max_cpu_s_per_gib=0.3, probe_bytes=32 * MiB, window=64 * MiB)
    for _ in range(100):  # 1.6 GiB at 0.06 CPU s/GiB
        pager._record(16 * MiB, 0.001)
    assert pager.enabled
    pager._record(16 * MiB, 0.047)  # then 3 s/GiB: a quarter of the window already
    pager._record(16 * MiB, 0.047)
    assert not pager.enabled and "CPU s/GiB" in (pager.reason or "")
