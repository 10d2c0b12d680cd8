"""The pure parts of the GPU copy path (windows, modes, file kinds); the copies themselves need a GPU.

What ran on a GPU is in docs/benchmarks.md (scripts/bench/bench_gpu_load.py, scripts/bench/gpu_model_proof.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxlaunch.plugin import cuda_copier, gpu_restore
from mxlaunch.plugin.cuda_copier import _OpenFile, windows_for

pytestmark = pytest.mark.unit

MiB = 1 << 20


def _file(size: int) -> _OpenFile:
    return _OpenFile(Path("x"), size, -1, False, None)


def test_windows_cover_every_tensor_byte_once_and_stay_aligned() -> None:
    chunk = 4 * MiB
    # header 1000 bytes, then a 10 MiB tensor spanning three windows, then two small ones sharing one
    big = torch.zeros(10 * MiB, dtype=torch.uint8)
    small_a = torch.zeros(100, dtype=torch.uint8)
    small_b = torch.zeros(3, 50, dtype=torch.float32)
    b0 = 1000
    items = [(b0, b0 + 10 * MiB, big), (b0 + 10 * MiB, b0 + 10 * MiB + 100, small_a),
             (b0 + 10 * MiB + 100, b0 + 10 * MiB + 700, small_b)]
    size = b0 + 10 * MiB + 700
    wins = windows_for(_file(size), items, chunk)
    assert [w.begin for w in wins] == [0, 4 * MiB, 8 * MiB]
    assert all(w.begin % (2 * MiB) == 0 for w in wins)
    assert wins[-1].end == -(-size // 4096) * 4096  # page-rounded end of file, not past it
    covered = sorted((p.begin, p.end) for w in wins for p in w.pieces)
    assert covered[0][0] == b0 and covered[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, no overlap
    for w in wins:
        for p in w.pieces:
            assert w.begin <= p.begin < p.end <= w.end
            assert p.dest.numel() == p.end - p.begin and p.dest.dtype == torch.uint8


def test_piece_destinations_are_views_of_the_targets() -> None:
    """Writing through the pieces fills the target tensors in file order (the copy's addressing)."""
    data = bytes(range(256)) * 40
    t1 = torch.zeros(2, 1000, dtype=torch.float16)  # 4000 bytes
    t2 = torch.zeros(6000, dtype=torch.uint8)
    items = [(240, 4240, t1), (4240, 10240, t2)]
    for w in windows_for(_file(10240), items, 4096):
        for p in w.pieces:
            p.dest.copy_(torch.frombuffer(bytearray(data[p.begin:p.end]), dtype=torch.uint8))
    assert t1.view(torch.uint8).reshape(-1).tolist() == list(data[240:4240])
    assert t2.tolist() == list(data[4240:10240])


def test_mode_and_readers_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_GPU_COPY", raising=False)
    assert gpu_restore.gpu_copy_mode() == "auto"
    monkeypatch.setenv("MXLAUNCH_GPU_COPY", "Ring")
    assert gpu_restore.gpu_copy_mode() == "ring"
    monkeypatch.setenv("MXLAUNCH_GPU_COPY", "bogus")
    assert gpu_restore.gpu_copy_mode() == "auto"
    monkeypatch.setenv("MXLAUNCH_GPU_READERS", "3")
    assert gpu_restore.ring_readers() == 3
    assert gpu_restore.ring_bytes(3) == 3 * 2 * cuda_copier.CHUNK


def test_cpu_targets_never_take_the_gpu_path() -> None:
    assert gpu_restore.GpuRestore.for_targets([torch.zeros(4)]) is None


def test_tmpfs_is_recognised(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    assert cuda_copier.is_tmpfs(shm) is True
    assert cuda_copier.is_tmpfs(Path("/proc")) is False
