"""mxlaunch stage: byte-exact copies, per-file readiness, refusal and cleanup on every failure path."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mxlaunch.errors import CheckFailed, UsageError
from mxlaunch.staging import reader as reader_mod
from mxlaunch.staging.reader import WRITE_MODES, StageCancelled, StageJob, stage
from mxlaunch.staging.sources import expand_sources

from tests.helpers.stage_data import sha256_of, shm_dest, tree_of, write_pattern_file

MiB = 1 << 20
SIZES = [0, 1, 4095, 4096, 4097, 16 * MiB - 1, 16 * MiB + 1]


dest = pytest.fixture(shm_dest, name="dest")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Files of the awkward sizes on the real disk (where O_DIRECT is honoured), with their hashes."""
    root = tmp_path_factory.mktemp("src")
    files = {}
    for n, size in enumerate(SIZES):
        path = root / f"f{size}.bin"
        files[path.name] = (path, write_pattern_file(path, size, seed=n))
    return files


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxlaunch.cli", *args], capture_output=True, text=True, **kwargs)


@pytest.mark.parametrize("mode", WRITE_MODES)
@pytest.mark.parametrize("chunk", [4096, 64 * 1024, 16 * MiB])
def test_every_awkward_size_is_byte_exact(sources, dest, chunk: int, mode: str) -> None:
    items = expand_sources([str(p) for p, _ in sources.values()])
    result = stage(items, dest, readers=8, chunk_size=chunk, write_mode=mode)
    assert result.o_direct is True  # ext4 source: every read used O_DIRECT
    assert result.bytes == sum(SIZES)
    for name, (_, digest) in sources.items():
        assert sha256_of(dest / name) == digest, name
    assert tree_of(dest) == sorted(sources)  # no .partial left


def test_file_over_one_gib_is_byte_exact(tmp_path: Path, dest: Path) -> None:
    big = tmp_path / "big.bin"
    digest = write_pattern_file(big, (1 << 30) + 4097, seed=7)
    for mode in WRITE_MODES:
        result = stage(expand_sources([str(big)]), dest, readers=16, write_mode=mode)
        assert result.bytes == (1 << 30) + 4097
        assert sha256_of(dest / "big.bin") == digest, mode
        shutil.rmtree(dest)


def test_directory_lands_under_its_basename_and_globs_expand(tmp_path: Path, dest: Path) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    h1 = write_pattern_file(model / "a.safetensors", 5000, seed=1)
    h2 = write_pattern_file(model / "sub" / "b.json", 10, seed=2)
    loose = tmp_path / "loose"
    loose.mkdir()
    h3 = write_pattern_file(loose / "x.bin", 70000, seed=3)
    stage(expand_sources([str(model), str(loose / "*.bin")]), dest, readers=4)
    assert sha256_of(dest / "model" / "a.safetensors") == h1
    assert sha256_of(dest / "model" / "sub" / "b.json") == h2
    assert sha256_of(dest / "x.bin") == h3


def test_two_sources_to_one_destination_is_usage_error_before_copying(tmp_path: Path, dest: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_pattern_file(tmp_path / "a" / "w.bin", 100)
    write_pattern_file(tmp_path / "b" / "w.bin", 100, seed=1)
    result = run_cli("stage", str(tmp_path / "a" / "w.bin"), str(tmp_path / "b" / "w.bin"), "--dest", str(dest))
    assert result.returncode == 2
    assert "would both land at" in result.stderr
    assert "Traceback" not in result.stderr
    assert not dest.exists()


def test_per_file_completion_is_visible_before_the_stage_ends(tmp_path: Path, dest: Path) -> None:
    paths = []
    for n in range(3):
        paths.append(tmp_path / f"part{n}.bin")
        write_pattern_file(paths[-1], 4 * MiB, seed=n)
    looked, holding = threading.Event(), threading.Event()

    def hold_once_the_first_file_is_in(n: int) -> None:  # the one reader, after each chunk
        if (dest / "part0.bin").exists() and not holding.is_set():
            holding.set()
            assert looked.wait(120)  # until the test has seen the folder with part2 not yet in

    job = StageJob(expand_sources([str(p) for p in paths]), dest, readers=1, chunk_size=MiB,
                   on_progress=hold_once_the_first_file_is_in).start()
    seen = []
    for staged in job.completed():
        assert staged.dest.exists() and staged.dest.stat().st_size == 4 * MiB
        if not seen:
            assert holding.wait(120)
            later = [p.name for p in dest.iterdir()]
            assert "part2.bin" not in later  # the last file is not there yet under its final name
            assert "part2.bin.partial" in later
            looked.set()
        seen.append(staged.rel)
    result = job.wait()
    assert seen == ["part0.bin", "part1.bin", "part2.bin"]  # file order: the first file lands first
    assert [f.rel for f in result.files] == seen


def test_too_small_destination_is_refused_and_left_empty(tmp_path: Path) -> None:
    src = tmp_path / "two_mib.bin"
    write_pattern_file(src, 2 * MiB)
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    try:
        if mounted:
            result = run_cli("stage", str(src), "--dest", str(mnt / "run"))
            assert result.returncode == 2, result.stderr
            assert "free space" in result.stderr or "RAM" in result.stderr or "memory" in result.stderr
            assert tree_of(mnt) == []
        # Whatever the mount: a reservation (what the engine itself needs) larger than what is
        # left takes the same path through the in-process API.
        with pytest.raises(UsageError, match="staging needs"):
            StageJob(expand_sources([str(src)]), tmp_path / "dest", reserve_bytes=1 << 62).start()
        assert not (tmp_path / "dest").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)


def test_reader_failure_midway_removes_everything(sources, dest, monkeypatch: pytest.MonkeyPatch) -> None:
    # A disk error cannot be produced on demand here: make the 20th read fail with EIO.
    real_preadv = os.preadv
    calls = {"n": 0}

    def flaky_preadv(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(reader_mod.os, "preadv", flaky_preadv)
    items = expand_sources([str(p) for p, _ in sources.values()])
    for mode in ("pwrite", "mmap"):  # in-process readers (a reader process cannot be patched from here)
        calls["n"] = 0
        with pytest.raises(CheckFailed, match="Input/output error"):
            stage(items, dest, readers=4, chunk_size=64 * 1024, write_mode=mode)
        assert not dest.exists()


@pytest.mark.parametrize("mode", WRITE_MODES)
def test_source_shrinking_during_the_stage_fails_and_cleans_up(tmp_path: Path, dest: Path, mode: str) -> None:
    src = tmp_path / "shrinks.bin"
    write_pattern_file(src, 8 * MiB)
    one_chunk_in, shrunk = threading.Event(), threading.Event()

    def hold_after_the_first_chunk(n: int) -> None:  # the one reader, right after a chunk is in
        if not one_chunk_in.is_set():
            one_chunk_in.set()
            assert shrunk.wait(120)

    job = StageJob(expand_sources([str(src)]), dest, readers=1, chunk_size=MiB, write_mode=mode,
                   on_progress=hold_after_the_first_chunk).start()
    assert one_chunk_in.wait(120)  # 1 of its 8 MiB copied, the rest not yet: it shrinks mid-stage
    os.truncate(src, 2 * MiB)
    shrunk.set()
    with pytest.raises(CheckFailed, match="did it change while staging"):
        job.wait()
    assert not dest.exists()


def test_cancel_removes_partial_and_finished_files(tmp_path: Path, dest: Path) -> None:
    paths = [tmp_path / "one.bin", tmp_path / "two.bin"]
    for n, (p, size) in enumerate(zip(paths, (MiB, 4 * MiB))):  # one chunk, then four
        write_pattern_file(p, size, seed=n)
    holding, cancelled = threading.Event(), threading.Event()

    def hold_inside_the_second_file(n: int) -> None:  # the one reader, right after a chunk is in
        if (dest / "one.bin").exists() and not holding.is_set():  # one.bin done: this was two.bin's 1st chunk
            holding.set()
            assert cancelled.wait(120)

    job = StageJob(expand_sources([str(p) for p in paths]), dest, readers=1, chunk_size=MiB,
                   on_progress=hold_inside_the_second_file).start()
    first = next(job.completed())
    assert first.rel == "one.bin" and first.dest.exists()
    assert holding.wait(120)  # two.bin has 1 of its 4 MiB: the cancel lands mid-copy
    assert (dest / "two.bin.partial").exists() and not (dest / "two.bin").exists()
    job.cancel()
    cancelled.set()
    with pytest.raises(StageCancelled):
        job.wait()
    assert not dest.exists()


def test_sigint_to_a_real_stage_process_cleans_up(tmp_path: Path, dest: Path) -> None:
    src = tmp_path / "slow.bin"
    write_pattern_file(src, 64 * MiB)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxlaunch.cli", "stage", str(src), "--dest", str(dest), "--rate-limit", "1MiB",
         "--chunk-size", "1MiB", "--readers", "2"],  # 64 s of copying: the SIGINT lands long before its end
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not (dest / "slow.bin.partial").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "interrupted by SIGINT" in stderr
    assert "Traceback" not in stderr
    assert not dest.exists()


def test_manifest_written_then_checked_and_a_mismatch_fails(sources, dest, tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    paths = [str(p) for p, _ in sources.values()]
    out = run_cli("stage", *paths, "--dest", str(dest), "--write-manifest", str(manifest), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["schema"] == 1 and summary["bytes"] == sum(SIZES) and summary["o_direct"] is True
    assert {Path(f["dest"]).name for f in summary["files"]} == set(sources)
    entries = json.loads(manifest.read_text())
    assert set(entries) == set(sources)
    shutil.rmtree(dest)

    ok = run_cli("stage", *paths, "--dest", str(dest), "--manifest", str(manifest))
    assert ok.returncode == 0, ok.stderr
    shutil.rmtree(dest)

    name = "f4097.bin"
    entries[name]["xxh3_128"] = "0" * 32
    manifest.write_text(json.dumps(entries))
    bad = run_cli("stage", *paths, "--dest", str(dest), "--manifest", str(manifest))
    assert bad.returncode == 1
    assert f"{name}: checksum" in bad.stderr
    assert not dest.exists()


def test_malformed_manifest_is_usage_error(sources, dest, tmp_path: Path) -> None:
    manifest = tmp_path / "bad.json"
    manifest.write_text("{not json")
    result = run_cli("stage", str(next(iter(sources.values()))[0]), "--dest", str(dest), "--manifest", str(manifest))
    assert result.returncode == 2
    assert "not valid JSON" in result.stderr and "Traceback" not in result.stderr
    assert not dest.exists()


def test_verify_rereads_the_source(sources, dest) -> None:
    result = stage(expand_sources([str(p) for p, _ in sources.values()]), dest, readers=4, verify_source=True)
    assert all(f.xxh3_128 for f in result.files)


def test_o_direct_refused_falls_back_to_buffered(sources, dest, monkeypatch: pytest.MonkeyPatch) -> None:
    # A filesystem that refuses O_DIRECT answers open() with EINVAL (no such fs can be mounted here).
    real_open = os.open

    def no_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader_mod.os, "open", no_direct_open)
    result = stage(expand_sources([str(p) for p, _ in sources.values()]), dest, readers=4)
    assert result.o_direct is False
    for name, (_, digest) in sources.items():
        assert sha256_of(dest / name) == digest


def test_bad_options_are_one_line_usage_errors(sources, dest) -> None:
    src = str(next(iter(sources.values()))[0])
    for args, needle in [
        (["--chunk-size", "1000"], "multiple of 4 KiB"),
        (["--chunk-size", "lots"], "cannot read size"),
        (["--readers", "0"], "--readers must be"),
    ]:
        result = run_cli("stage", src, "--dest", str(dest), *args)
        assert result.returncode == 2, (args, result.stderr)
        assert needle in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not dest.exists()
