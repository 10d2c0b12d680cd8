"""The early registrar's bookkeeping, with the CUDA driver's register/unregister replaced by a ledger.

There is no GPU here (CI has none); what is real: the files in /dev/shm, their read-only mappings, the
thread that waits for them to land, and the take/claim/stop rules the restore relies on. The driver
calls themselves ran on the H200 (scripts/bench/bench_gpu_load.py, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from mxlaunch.plugin import early_register, pinned

pytestmark = pytest.mark.unit


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Registered ranges by address; registering twice or unregistering an unknown address fails."""
    pinned_now: dict[int, int] = {}
    lock = threading.Lock()

    def register(addr: int, n: int, *, read_only: bool = False) -> None:
        assert read_only and n % 4096 == 0
        with lock:
            assert addr not in pinned_now
            pinned_now[addr] = n

    def unregister(addr: int) -> None:
        with lock:
            del pinned_now[addr]

    monkeypatch.setattr(pinned, "register", register)
    monkeypatch.setattr(pinned, "unregister", unregister)
    import torch

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return pinned_now


@pytest.fixture
def shm_dir():
    base = Path("/dev/shm")
    if not base.is_dir():
        pytest.skip("no /dev/shm")
    d = base / f"mx-early-test-{os.getpid()}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _land(path: Path, size: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(os.urandom(size))
    os.replace(tmp, path)


def test_files_are_registered_as_they_land_and_taken_once(ledger: dict[int, int], shm_dir: Path) -> None:
    files = [shm_dir / f"part-{i}.safetensors" for i in range(3)]
    _land(files[0], 600_000)
    reg = early_register.EarlyRegistrar(0, files, timeout_s=60)
    time.sleep(0.05)
    _land(files[1], 5000)
    _land(files[2], 1 << 20)
    reg.wait()
    assert reg.error is None
    assert reg.registered_bytes == 600_000 + 5000 + (1 << 20)
    assert sum(ledger.values()) == sum(pinned.page_up(os.path.getsize(f)) for f in files)
    first = reg.take(str(files[0]))
    assert first is not None and first.size == 600_000
    assert bytes(first.mapping.view[:16]) == files[0].read_bytes()[:16]  # the file's own bytes
    assert reg.take(files[0]) is None  # taken once; a second ask is the ring's
    reg.stop()  # releases files 1 and 2, which nobody took
    assert set(ledger) == set(first.addrs)
    first.release()
    assert ledger == {}


def test_a_file_the_restore_claimed_first_is_not_registered(ledger: dict[int, int], shm_dir: Path) -> None:
    late = shm_dir / "late.safetensors"
    reg = early_register.EarlyRegistrar(0, [late], timeout_s=10)
    assert reg.take(late) is None  # not there yet: the restore reads it through the ring
    _land(late, 10_000)
    reg.wait()
    assert ledger == {} and reg.registered_bytes == 0
    reg.stop()


def test_stop_ends_a_thread_still_waiting_and_leaves_nothing_pinned(ledger: dict[int, int], shm_dir: Path) -> None:
    have, never = shm_dir / "a.safetensors", shm_dir / "never.safetensors"
    _land(have, 8192)
    reg = early_register.EarlyRegistrar(0, [have, never], timeout_s=3600)
    deadline = time.monotonic() + 60
    while reg.registered_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ledger) == 1
    started = time.perf_counter()
    reg.stop()
    assert time.perf_counter() - started < 60  # long before its 3600 s wait for the file that never comes
    assert ledger == {}


def test_a_cancelled_launch_stops_the_wait(ledger: dict[int, int], shm_dir: Path) -> None:
    flag = threading.Event()
    reg = early_register.EarlyRegistrar(0, [shm_dir / "never.safetensors"], timeout_s=3600, cancelled=flag.is_set)
    flag.set()
    assert reg.wait() < 60  # long before its 3600 s timeout
    reg.stop()
    assert ledger == {}


def test_files_off_tmpfs_are_left_to_the_ring(ledger: dict[int, int], tmp_path: Path) -> None:
    from mxlaunch.plugin.cuda_copier import is_tmpfs

    disk = tmp_path / "part.safetensors"
    disk.write_bytes(b"x" * 4096)
    if is_tmpfs(tmp_path):
        pytest.skip("tmp_path is on tmpfs here")
    assert early_register.register_file(str(disk)) is None
    assert ledger == {}
