"""Capacity: cgroup memory limits (v1 and v2, read from real-format files) and size parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxlaunch.staging.capacity import Capacity, capacity_of, cgroup_memory_headroom, parse_size


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_tightest_limit_up_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
    job = root / "system.slice" / "slurmstepd.scope" / "job_42"
    _write(job / "memory.max", "8589934592\n")          # 8 GiB job limit
    _write(job / "memory.current", "1073741824\n")      # 1 GiB used
    _write(job.parent / "memory.max", "max\n")
    _write(job.parent / "memory.current", "5000000000\n")
    proc = tmp_path / "cgroup"
    _write(proc, "0::/system.slice/slurmstepd.scope/job_42\n")
    assert cgroup_memory_headroom(str(proc), root) == 7 * (1 << 30)
    _write(job.parent / "memory.max", "6442450944\n")   # a parent at 6 GiB with 5e9 used binds harder
    assert cgroup_memory_headroom(str(proc), root) == 6442450944 - 5000000000


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    leaf = root / "memory" / "slurm" / "uid_0" / "job_7"
    _write(leaf / "memory.limit_in_bytes", str(4 << 30))
    _write(leaf / "memory.usage_in_bytes", str(1 << 30))
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # unlimited
    proc = tmp_path / "cgroup"
    _write(proc, "12:pids:/slurm\n4:memory:/slurm/uid_0/job_7\n0::/\n")
    assert cgroup_memory_headroom(str(proc), root) == 3 << 30


def test_no_limit_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "memory\n")
    _write(root / "memory.max", "max\n")
    proc = tmp_path / "cgroup"
    _write(proc, "0::/\n")
    assert cgroup_memory_headroom(str(proc), root) is None


def test_memory_backed_destination_is_bound_by_the_cgroup() -> None:
    cap = Capacity(path="/dev/shm", fs_type="tmpfs", fs_free=100, memory_backed=True, cgroup_headroom=40,
                   ram_available=90)
    assert cap.usable == 40 and "cgroup" in cap.binding_limit
    disk = Capacity(path="/x", fs_type="ext4", fs_free=100, memory_backed=False, cgroup_headroom=40,
                    ram_available=90)
    assert disk.usable == 100


def test_dev_shm_is_memory_backed_here() -> None:
    cap = capacity_of("/dev/shm/not-there-yet/sub")
    assert cap.memory_backed and cap.path == "/dev/shm" and cap.usable > 0


@pytest.mark.parametrize("text,value", [("16MiB", 16 << 20), ("4k", 4096), ("1G", 1 << 30), ("123", 123),
                                        ("1.5GiB", 3 << 29), ("2 MB", 2 << 20)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "12XB", "MiB"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)
