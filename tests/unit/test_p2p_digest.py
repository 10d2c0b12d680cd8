"""Checksums of what a P2P target pulled (transfer/digest.py): the algorithms themselves, and issue 29's
attack through real NIXL — an outsider with a source's record WRITEs into its registered memory; a target
that pulls afterwards refuses the bytes (landed: rebuild + default loader, exact), never serves them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mxlaunch.plugin import p2p
from mxlaunch.plugin.loader import module_tensors
from mxlaunch.plugin.tensors import RestoreError
from mxlaunch.transfer import digest as digest_module
from mxlaunch.transfer.digest import MIX, XXH3, digest, digests, mismatches, mix_reference
from mxlaunch.transfer.tensor_set import describe, processed_tensors
from mxlaunch.plugin.tensors import group_tensors
from tests.helpers.p2p_models import build
from tests.helpers.p2p_peer import SOURCE_ID
from tests.unit.test_p2p_nixl import ROOT, equal_to_seed0, registry, sources  # noqa: F401 - the fixture
from tests.unit.test_p2p_strategy import Engine, markers, plan_for

pytestmark = pytest.mark.unit


# ---- the algorithms ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 64, 1001])
def test_mx128_in_torch_equals_its_plain_python_definition(n: int) -> None:
    data = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for off in (0, 3):  # an aligned and a misaligned start (a view inside a packed tensor)
        part = data[off:off + n]
        assert digest(part, MIX) == mix_reference(bytes(part.tolist()))


@pytest.mark.parametrize("algo", [XXH3, MIX])
def test_every_changed_byte_changes_the_digest(algo: str) -> None:
    t = torch.randn(75)  # 300 bytes: not a whole number of words
    want = digest(t, algo)
    raw = t.view(torch.uint8)
    for i in range(raw.numel()):
        raw[i] ^= 0x01
        assert digest(t, algo) != want, i
        raw[i] ^= 0x01
    assert digest(t, algo) == want


def test_swapped_words_and_a_longer_zero_tail_change_mx128() -> None:
    t = torch.arange(16, dtype=torch.int64)
    swapped = t.clone()
    swapped[[3, 9]] = swapped[[9, 3]]
    assert digest(t, MIX) != digest(swapped, MIX)
    z = torch.zeros(16, dtype=torch.uint8)
    assert digest(z, MIX) != digest(torch.zeros(17, dtype=torch.uint8), MIX)  # same padded words, other length


def test_a_strided_view_is_checked_over_the_span_it_moves_and_the_source_picks_by_device() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[:, :3]
    assert digest(view).startswith(XXH3 + ":")
    before = digest(view)
    base[1, 4] = -1.0  # inside the view's span (the bytes a transfer copies), outside its elements
    assert digest(view) != before


def test_batched_mx128_is_each_tensors_own_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched form (one concatenated pass, sums per tensor) gives every tensor the digest it has alone:
    empty, sub-word, misaligned and strided tensors, batches cut by size, tensors too big to batch (hashed a chunk
    at a time, their sums kept on the device with the batches' until the end), and xxh3 entries in between; a byte changed in one tensor of a batch changes that tensor's digest only."""
    monkeypatch.setattr(digest_module, "CHUNK", 4096)  # several batches from small tensors
    monkeypatch.setattr(digest_module, "BATCHED", 2048)
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (20000,), dtype=torch.uint8, generator=g)
    tensors = [raw[:0], raw[3:4], raw[5:12], raw[16:24], raw[40:1041], raw[1:3001], torch.randn(6, 9)[:, :4],
               raw[7000:7777], torch.arange(300, dtype=torch.int16)] + [raw[100 * i + 1:100 * i + 1 + i] for i in range(40)]
    algos = [MIX] * len(tensors)
    algos[4] = XXH3
    assert digests(tensors, algos) == [digest(t, a) for t, a in zip(tensors, algos)]
    assert digests(tensors[:3], [MIX] * 3) == [mix_reference(bytes(t.tolist())) for t in tensors[:3]]
    large = [raw[1:9001], raw[3:4], raw[9100:9100 + 4096]]  # three chunks from a misaligned start; one exact chunk
    assert digests(large, [MIX] * 3) == [mix_reference(bytes(t.tolist())) for t in large]
    before = digests(tensors, algos)
    raw[7100] ^= 0xFF  # inside tensors[7] only
    after = digests(tensors, algos)
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [7]


def test_mismatches_names_what_differs_and_an_entry_without_a_digest() -> None:
    model = build(0)
    named = processed_tensors(model)
    groups = [g for g in group_tensors(named) if g.tensor.numel()]
    entries = describe(groups)
    for g, e in zip(groups, entries):
        e["digest"] = digest(g.tensor)
    assert mismatches(named, entries) == []
    model.embed.weight.data[0, 0] += 1.0
    assert mismatches(named, entries) == ["embed.weight"]
    entries[1].pop("digest")
    assert entries[1]["name"] in mismatches(named, entries)


# ---- the attack, through real NIXL ----------------------------------------------------------------------


def attack(tmp_path: Path, tensor: str = "embed.weight") -> dict:
    out = tmp_path / "attack.json"
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.p2p_peer", "attack", "--registry", str(tmp_path / "reg"),
                           "--tensor", tensor, "--out", str(out)], cwd=ROOT, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["raw", "processed"])
def test_an_outsiders_write_into_a_source_is_caught_before_the_target_serves(tmp_path, sources, layout) -> None:
    sources("--layout", layout)
    wrote = attack(tmp_path)
    assert wrote.get("wrote", 0) > 0, wrote  # NIXL lets it: registered memory is remotely writable
    target = build(7, post=layout == "processed")
    named = processed_tensors(target) if layout == "processed" else module_tensors(target)
    with pytest.raises(RestoreError, match="differ from the checksums it published") as info:
        p2p.pull(named, registry=registry(tmp_path), source_id=SOURCE_ID, rank=0, world=1, layout=layout)
    assert info.value.landed is True and "embed.weight" in str(info.value)


def test_after_the_attack_the_strategy_rebuilds_and_serves_the_default_loaders_weights(tmp_path, sources) -> None:
    sources("--layout", "raw")
    assert attack(tmp_path).get("wrote", 0) > 0
    plan = plan_for(tmp_path, "raw", serve=False)
    engine = Engine(plan, "raw")
    model = engine.load()
    assert engine.builds == 2 and equal_to_seed0(model)  # never the attacked bytes
    reason = markers(plan)["fallback-0"]["reason"]
    assert "differ from the checksums" in reason and "building the model again" in reason


def test_a_source_that_publishes_no_checksums_is_passed_over_before_any_byte_moves(tmp_path, sources) -> None:
    sources("--layout", "raw")
    reg = registry(tmp_path)
    (entry,) = reg.sources(SOURCE_ID, 0)
    old = entry.record
    bare = replace(old, worker="no-digests", pid=__import__("os").getpid(), start_time=0,
                   tensors=[{k: v for k, v in t.items() if k != "digest"} for t in old.tensors])
    reg.remove(SOURCE_ID, 0, old.worker)
    pub = reg.publish(bare)
    target = build(7, post=False)
    before = [t.clone() for _, t in module_tensors(target)]
    try:
        with pytest.raises(RestoreError, match="publishes no checksum") as info:
            p2p.pull(module_tensors(target), registry=reg, source_id=SOURCE_ID, rank=0, world=1, layout="raw")
        assert info.value.landed is False
        assert all(torch.equal(a, b) for a, (_, b) in zip(before, module_tensors(target)))
    finally:
        pub.unpublish()


@pytest.mark.parametrize("layout", ["raw", "processed"])
def test_peers_verify_asks_a_live_source_to_prove_its_bytes_and_a_written_one_stops_serving(tmp_path, sources,
                                                                                           layout) -> None:
    from tests.helpers.cli import run_cli

    # a long ttl: the source stays live however starved it is; its heartbeat thread looks for the request
    # every second between beats (every ttl/3 = 10 s)
    source = sources("--layout", layout, "--ttl", "30")
    args = ("peers", "--registry", f"file:{tmp_path / 'reg'}", "--verify", "--timeout", "120", "--json")
    good = run_cli(*args)
    assert good.returncode == 0, good.stderr
    (v,) = json.loads(good.stdout)["verified"]
    assert v["ok"] is True and v["worker"] == source.worker and v["tensors"] > 0
    assert attack(tmp_path).get("wrote", 0) > 0
    bad = run_cli(*args)
    assert bad.returncode == 1, bad.stderr
    (v,) = json.loads(bad.stdout)["verified"]
    assert v["ok"] is False and "embed.weight" in v["bad"]
    # it stopped offering its changed bytes: the record is removed (unpublished), not merely stale. It
    # unpublishes right after it answers, so give its thread time to get there.
    deadline = time.monotonic() + 60
    while registry(tmp_path).sources(SOURCE_ID, 0, include_stale=True) != []:
        assert time.monotonic() < deadline, "the source whose bytes changed never unpublished"
        time.sleep(0.1)
    assert source.proc.poll() is None  # still running: it withdrew itself, it did not die


def test_peers_verify_reports_a_source_that_does_not_answer(tmp_path) -> None:
    from mxlaunch.coord.peers import local_record
    from tests.helpers.cli import run_cli

    reg = registry(tmp_path)
    pub = reg.publish(local_record(SOURCE_ID, 0, 1, layout="raw", worker="silent", run_id="r", device="cpu",
                                   agent_metadata=b"md", tensors=[]), ttl_s=600)  # no heartbeat thread: no answer
    try:
        result = run_cli("peers", "--registry", f"file:{tmp_path / 'reg'}", "--verify", "--timeout", "1", "--json")
        assert result.returncode == 1
        (v,) = json.loads(result.stdout)["verified"]
        assert v["ok"] is False and v["error"] == "no answer"
    finally:
        pub.unpublish()
