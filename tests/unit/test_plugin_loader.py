"""The plugin's engine-neutral core on real torch modules (CPU): capture → restore is bit-identical, and
every way a snapshot can be wrong gives the right error with the right `landed` flag."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from mxlaunch.plugin.loader import (
    ALIASES_KEY,
    LayoutMismatch,
    RestoreError,
    SnapshotCorrupt,
    SnapshotTimeout,
    capture_tensors,
    group_tensors,
    module_tensors,
    read_header,
    restore_tensors,
)

pytestmark = pytest.mark.unit


class Tiny(nn.Module):
    """Tied embedding/lm_head, a persistent and a non-persistent buffer, a bf16 and an int tensor."""

    def __init__(self, vocab: int = 97, hidden: int = 16, seed: int | None = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one storage, two names
        self.bf = nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("table", torch.zeros(7, dtype=torch.int64))
        self.register_buffer("scale", torch.zeros(()))  # 0-dim persistent buffer
        self.register_buffer("cache", torch.zeros(4), persistent=False)
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for _, t in module_tensors(self):
                    if t.dtype.is_floating_point:
                        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
                    else:
                        t.copy_(torch.randint(0, 1000, t.shape, generator=g))
        else:
            with torch.no_grad():  # a "freshly built" engine model: garbage-ish values
                for _, t in module_tensors(self):
                    t.fill_(-1)
                self.cache.fill_(42)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module_tensors(module)}


def files_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("part-*.safetensors"))


# ---- capture → restore ----------------------------------------------------------------------------------


def test_module_tensors_names_tied_and_persistent_only() -> None:
    names = [n for n, _ in module_tensors(Tiny())]
    assert "lm_head.weight" in names and "embed.weight" in names
    assert "table" in names and "scale" in names
    assert "cache" not in names  # non-persistent: built at init, never captured
    groups = group_tensors(module_tensors(Tiny()))
    tied = [g for g in groups if len(g.names) > 1]
    assert [sorted(g.names) for g in tied] == [["embed.weight", "lm_head.weight"]]


def test_capture_then_restore_is_bit_identical(tmp_path: Path) -> None:
    src = Tiny(seed=0)
    result = capture_tensors(module_tensors(src), tmp_path / "0", fsync=False)
    files = files_of(tmp_path / "0")
    assert files == result.files and [f.name for f in files] == ["part-00000.safetensors"]
    assert not list((tmp_path / "0").glob(".*"))  # no temp files left
    groups = group_tensors(module_tensors(src))
    assert result.tensors == len(groups)
    assert result.bytes == sum(g.tensor.numel() * g.tensor.element_size() for g in groups)

    dst = Tiny(seed=None)
    assert dst.lm_head.weight is dst.embed.weight
    restored = restore_tensors(module_tensors(dst), files, wait_timeout_s=1)
    assert restored.bytes == result.bytes and restored.tensors == result.tensors
    want, got = state(src), state(dst)
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].dtype == got[name].dtype
        assert torch.equal(want[name].view(-1).view(torch.uint8) if want[name].dim() else want[name],
                           got[name].view(-1).view(torch.uint8) if got[name].dim() else got[name]), name
    assert dst.lm_head.weight is dst.embed.weight  # still tied
    assert torch.equal(dst.cache, torch.full((4,), 42.0))  # non-persistent: untouched


def test_tied_weights_saved_once_with_aliases_and_safetensors_can_read_it(tmp_path: Path) -> None:
    from safetensors import safe_open

    capture_tensors(module_tensors(Tiny()), tmp_path, fsync=False)
    (path,) = files_of(tmp_path)
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        meta = fh.metadata()
        assert torch.equal(fh.get_tensor("embed.weight"), Tiny().embed.weight.detach())
    assert "embed.weight" in keys and "lm_head.weight" not in keys
    assert json.loads(meta[ALIASES_KEY]) == {"embed.weight": ["lm_head.weight"]}
    assert meta["format"] == "pt"


def test_parts_split_by_size_deterministically(tmp_path: Path) -> None:
    src = Tiny()
    a = capture_tensors(module_tensors(src), tmp_path / "a", part_bytes=1024, fsync=False)
    b = capture_tensors(module_tensors(src), tmp_path / "b", part_bytes=1024, fsync=False)
    assert len(a.files) > 2
    assert [f.name for f in a.files] == [f"part-{i:05d}.safetensors" for i in range(len(a.files))]
    assert [f.read_bytes() for f in a.files] == [f.read_bytes() for f in b.files]
    # Every part except oversized single tensors respects the limit.
    for f in a.files:
        header = read_header(f)
        assert header.bytes <= 1024 or len(header.entries) == 1
    dst = Tiny(seed=None)
    restore_tensors(module_tensors(dst), a.files, wait_timeout_s=1)
    assert all(torch.equal(x, y) for x, y in zip(state(src).values(), state(dst).values()))


def test_restore_checks_expected_file_size(tmp_path: Path) -> None:
    (path,) = capture_tensors(module_tensors(Tiny()), tmp_path, fsync=False).files
    with pytest.raises(SnapshotCorrupt, match="the snapshot says") as err:
        restore_tensors(module_tensors(Tiny(seed=None)), [(str(path), path.stat().st_size + 8)], wait_timeout_s=1)
    assert err.value.landed is False


# ---- wrong snapshots ---------------------------------------------------------------------------------------


class Smaller(Tiny):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        del self.blocks[1]


class Extra(Tiny):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.extra = nn.Parameter(torch.zeros(2))


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Smaller()), tmp_path, fsync=False).files
    with pytest.raises(LayoutMismatch, match=r"lacks 2 tensor\(s\).*blocks\.1\.weight") as err:
        restore_tensors(module_tensors(Tiny(seed=None)), files, wait_timeout_s=1)
    assert err.value.landed is False  # all files present: caught before a byte landed


def test_missing_tensor_in_a_late_file_is_an_error_after_landing(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Smaller()), tmp_path / "snap", part_bytes=1024, fsync=False).files
    late = tmp_path / "late"
    late.mkdir()
    names = [late / f.name for f in files]
    os.replace(files[0], names[0])
    waiting = threading.Event()

    def cancelled() -> bool:  # restore asks this only while it waits for a file that is not there yet
        waiting.set()
        return False

    def arrive() -> None:  # the later files come only once restore waits for them: past its up-front check
        if not waiting.wait(120):
            return
        for f, dst in zip(files[1:], names[1:]):
            os.replace(f, dst)

    t = threading.Thread(target=arrive)
    t.start()
    try:
        with pytest.raises(LayoutMismatch, match="lacks") as err:
            restore_tensors(module_tensors(Tiny(seed=None)), names, wait_timeout_s=60, cancelled=cancelled)
    finally:
        waiting.set()
        t.join()
    assert err.value.landed is True


def test_extra_tensor_is_an_error_before_landing(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Extra()), tmp_path, fsync=False).files
    dst = Tiny(seed=None)
    before = state(dst)
    with pytest.raises(LayoutMismatch, match="does not have: extra") as err:
        restore_tensors(module_tensors(dst), files, wait_timeout_s=1)
    assert err.value.landed is False
    assert all(torch.equal(before[k], v) for k, v in state(dst).items())  # nothing was written


def test_shape_mismatch(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Tiny(vocab=98)), tmp_path, fsync=False).files
    with pytest.raises(LayoutMismatch, match=r"embed\.weight: the snapshot has \[98, 16\] F32, the model \[97, 16\]"):
        restore_tensors(module_tensors(Tiny(seed=None)), files, wait_timeout_s=1)


def test_dtype_mismatch(tmp_path: Path) -> None:
    src = Tiny()
    src.bf = nn.Parameter(torch.zeros(3, 5, dtype=torch.float16), requires_grad=False)
    files = capture_tensors(module_tensors(src), tmp_path, fsync=False).files
    with pytest.raises(LayoutMismatch, match=r"bf: the snapshot has \[3, 5\] F16, the model \[3, 5\] BF16"):
        restore_tensors(module_tensors(Tiny(seed=None)), files, wait_timeout_s=1)


def test_untied_target_for_a_tied_snapshot(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Tiny()), tmp_path, fsync=False).files
    dst = Tiny(seed=None)
    dst.lm_head.weight = nn.Parameter(dst.embed.weight.detach().clone())  # untie
    with pytest.raises(LayoutMismatch, match="ties lm_head.weight to embed.weight, the model does not"):
        restore_tensors(module_tensors(dst), files, wait_timeout_s=1)


def test_tensor_in_two_files_is_filled_twice(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Tiny()), tmp_path, fsync=False).files
    with pytest.raises(LayoutMismatch, match="filled twice"):
        restore_tensors(module_tensors(Tiny(seed=None)), [files[0], files[0]], wait_timeout_s=1)


def test_corrupt_files(tmp_path: Path) -> None:
    (path,) = capture_tensors(module_tensors(Tiny()), tmp_path, fsync=False).files
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-10])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 12) + b"not json!!!!" + b"\0" * 64)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    for bad, pattern in ((truncated, "do not fit"), (garbage, "not valid JSON"), (tiny, "too short")):
        with pytest.raises(SnapshotCorrupt, match=pattern) as err:
            restore_tensors(module_tensors(Tiny(seed=None)), [bad], wait_timeout_s=1)
        assert err.value.landed is False


# ---- waiting for the stager ----------------------------------------------------------------------------------


def test_file_that_never_appears_times_out(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(SnapshotTimeout, match="did not appear within 0.3 s") as err:
        restore_tensors(module_tensors(Tiny(seed=None)), [tmp_path / "never.safetensors"], wait_timeout_s=0.3)
    assert time.monotonic() - started >= 0.3  # it waited the whole timeout (the message says it gave up)
    assert err.value.landed is False and isinstance(err.value, RestoreError)


def test_an_abort_stops_the_wait_before_the_timeout(tmp_path: Path) -> None:
    # The launcher writes markers/abort.json when staging fails; the plugin passes that check as `cancelled`.
    abort = tmp_path / "abort.json"
    threading.Timer(0.2, abort.write_text, args=("{}",)).start()
    started = time.monotonic()
    with pytest.raises(RestoreError, match="cancelled while waiting") as err:
        restore_tensors(module_tensors(Tiny(seed=None)), [tmp_path / "never.safetensors"], wait_timeout_s=3600,
                        cancelled=abort.exists)  # "cancelled", not "did not appear": the abort ended the wait
    assert err.value.landed is False


def test_second_file_never_appears_after_first_landed(tmp_path: Path) -> None:
    files = capture_tensors(module_tensors(Tiny()), tmp_path, part_bytes=1024, fsync=False).files
    with pytest.raises(SnapshotTimeout) as err:
        restore_tensors(module_tensors(Tiny(seed=None)), [files[0], tmp_path / "gone.safetensors"], wait_timeout_s=0.2)
    assert err.value.landed is True


def test_restore_waits_for_partial_then_rename(tmp_path: Path) -> None:
    """The stager writes <name>.partial and renames it when complete: restore waits for the final name."""
    src = Tiny(seed=3)
    snap = capture_tensors(module_tensors(src), tmp_path / "snap", part_bytes=2048, fsync=False).files
    run = tmp_path / "run" / "0"
    run.mkdir(parents=True)
    targets = [run / f.name for f in snap]
    seen_partial = threading.Event()
    waiting = threading.Event()

    def cancelled() -> bool:  # restore asks this only while it waits for a file that is not there yet
        waiting.set()
        return False

    def stager() -> None:
        for n, (f, dst) in enumerate(zip(snap, targets)):
            partial = dst.with_name(dst.name + ".partial")
            data = f.read_bytes()
            with open(partial, "wb") as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                seen_partial.set()
                if n == 0:
                    waiting.wait(120)  # restore is waiting for the first file: the 0.15 s below are its wait
                time.sleep(0.15)
                fh.write(data[len(data) // 2:])
            os.replace(partial, dst)

    dst_model = Tiny(seed=None)
    t = threading.Thread(target=stager)
    t.start()
    try:
        result = restore_tensors(module_tensors(dst_model), [(str(p), f.stat().st_size) for p, f in zip(targets, snap)],
                                 wait_timeout_s=120, cancelled=cancelled)
    finally:
        waiting.set()
        t.join()
    assert seen_partial.is_set()
    assert result.files == len(snap) > 1 and result.wait_seconds >= 0.15
    assert all(torch.equal(x, y) for x, y in zip(state(src).values(), state(dst_model).values()))


def test_stagejob_stages_a_snapshot_that_restores(tmp_path: Path) -> None:
    """The real stager (files appear by rename) feeding restore, as the launcher runs them."""
    from mxlaunch.staging.reader import StageJob
    from mxlaunch.staging.sources import expand_sources

    src = Tiny(seed=5)
    capture_tensors(module_tensors(src), tmp_path / "store" / "0", part_bytes=2048, fsync=False)
    items = expand_sources([str(tmp_path / "store" / "0")])
    dest = tmp_path / "run"
    job = StageJob(items, dest, readers=2, use_o_direct=False).start()
    files = [(str(dest / it.rel), it.size) for it in items]
    dst_model = Tiny(seed=None)
    restore_tensors(module_tensors(dst_model), files, wait_timeout_s=30)
    job.wait()
    assert all(torch.equal(x, y) for x, y in zip(state(src).values(), state(dst_model).values()))


def test_plugin_modules_import_without_torch() -> None:
    """register() runs in every vLLM process: importing the entry point must not pull torch or vLLM in."""
    code = ("import sys; import mxlaunch.plugin.vllm as v; v.register(); "
            "bad=[m for m in ('torch','vllm','mxlaunch.plugin.loader') if m in sys.modules]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
