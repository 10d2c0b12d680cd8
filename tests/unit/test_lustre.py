"""Lustre layouts from `lfs getstripe` text (written from Lustre's documented output formats, since
Lustre cannot be installed here) and the read schedule they produce."""

from __future__ import annotations

import pytest

from mxlaunch.staging.lustre import EOF_END, Component, Layout, parse_getstripe
from mxlaunch.staging.schedule import (LOCAL_TARGET, MAX_READERS, READERS_PER_OST, Chunk, ChunkScheduler, cut_chunks,
                                       readers_for_layouts)
from mxlaunch.staging.lustre_samples import PFL_PLAIN, PFL_YAML, PLAIN_MULTI, PLAIN_SINGLE, YAML_MULTI

MiB = 1 << 20


def test_plain_multi_stripe() -> None:
    layout = parse_getstripe(PLAIN_MULTI)
    (comp,) = layout.components
    assert (comp.start, comp.end, comp.stripe_size, comp.osts) == (0, EOF_END, 4 * MiB, [5, 6, 7, 0])
    assert [layout.ost_for(n * 4 * MiB) for n in range(6)] == [5, 6, 7, 0, 5, 6]
    assert layout.stripe_end(MiB) == 4 * MiB


def test_plain_single_stripe() -> None:
    layout = parse_getstripe(PLAIN_SINGLE)
    assert layout.ost_set == {3}
    assert layout.ost_for(123 * MiB) == 3


def test_yaml_multi_stripe() -> None:
    layout = parse_getstripe(YAML_MULTI)
    assert layout.components[0].osts == [1, 2]
    assert [layout.ost_for(n * MiB) for n in range(4)] == [1, 2, 1, 2]


def test_pfl_composite_plain() -> None:
    layout = parse_getstripe(PFL_PLAIN)
    assert [(c.start, c.end, c.osts) for c in layout.components] == [
        (0, 4 * MiB, [0]),
        (4 * MiB, 64 * MiB, [1, 2]),
        (64 * MiB, EOF_END, [3, 4, 5, 6]),
    ]
    assert layout.ost_for(3 * MiB) == 0
    assert layout.ost_for(4 * MiB) == 1 and layout.ost_for(5 * MiB) == 2
    assert layout.ost_for(64 * MiB) == 3 and layout.ost_for(68 * MiB) == 4
    assert layout.stripe_end(63 * MiB + 5) == 64 * MiB


def test_pfl_composite_yaml_with_uninstantiated_component() -> None:
    layout = parse_getstripe(PFL_YAML)
    assert [c.osts for c in layout.components] == [[0], []]
    assert layout.ost_for(MiB) == 0
    assert layout.ost_for(5 * MiB) is None


@pytest.mark.parametrize("text", ["", "lfs: getstripe: cannot open 'x': No such file or directory (2)\n",
                                  "error on ioctl 0x4008669a for '/tmp/x' (3): Inappropriate ioctl for device"])
def test_non_layout_text_is_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_getstripe(text)


def test_chunks_are_cut_at_stripe_boundaries_and_target_one_ost() -> None:
    layout = parse_getstripe(PLAIN_MULTI)  # 4 MiB stripes
    chunks = cut_chunks([10 * MiB], 16 * MiB, [layout])
    assert [(c.offset, c.length, c.target) for c in chunks] == [
        (0, 4 * MiB, "ost5"), (4 * MiB, 4 * MiB, "ost6"), (8 * MiB, 2 * MiB, "ost7")]


def test_without_lustre_the_order_is_file_major() -> None:
    chunks = cut_chunks([3 * MiB, 2 * MiB], MiB)
    order = ChunkScheduler(chunks, readers=4).order()
    assert {c.target for c in order} == {LOCAL_TARGET}
    assert [(c.file_index, c.offset // MiB) for c in order] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_every_ost_gets_requests_and_depth_is_bounded() -> None:
    # Two files on different OST sets: a naive file-major order would leave OSTs 1,2 idle while
    # file 0 (OSTs 5,6,7,0) is read. The scheduler starts on all six OSTs at once.
    layouts = [parse_getstripe(PLAIN_MULTI), parse_getstripe(YAML_MULTI)]
    chunks = cut_chunks([32 * MiB, 8 * MiB], 16 * MiB, layouts)
    sched = ChunkScheduler(chunks, readers=6, depth_per_target=1)
    first_wave = [sched.take() for _ in range(6)]
    assert {c.target for c in first_wave} == {"ost5", "ost6", "ost7", "ost0", "ost1", "ost2"}
    # Every OST is at its depth bound: the next OST with work waits for one of its own reads.
    assert sched._pick() is None
    sched.done(first_wave[0])
    nxt = sched.take()
    assert nxt is not None and nxt.target == first_wave[0].target


def test_lustre_order_is_fair_across_osts_and_keeps_file_order_within_each() -> None:
    layout = parse_getstripe(PFL_PLAIN)
    chunks = cut_chunks([80 * MiB], 16 * MiB, [layout])
    order = ChunkScheduler(chunks, readers=8).order()
    assert covered(order) == covered(chunks)  # every byte once, on its chunk's OST (tails may come in pieces)
    per_target: dict[str, list[int]] = {}
    for chunk in order:
        per_target.setdefault(chunk.target, []).append(chunk.offset)
    assert set(per_target) == {f"ost{n}" for n in range(7)}
    assert all(offsets == sorted(offsets) for offsets in per_target.values())
    # The first 7 requests cover all 7 OSTs instead of queueing on OST 0's 4 chunks first.
    assert {c.target for c in order[:7]} == set(per_target)


def covered(chunks: list[Chunk]) -> list[tuple[int, int, int, str]]:
    """The chunks as (file, start, end, target) runs, adjacent ranges of one target merged."""
    runs: list[tuple[int, int, int, str]] = []
    for c in sorted(chunks, key=lambda c: (c.file_index, c.offset)):
        if runs and runs[-1][0] == c.file_index and runs[-1][2] == c.offset and runs[-1][3] == c.target:
            runs[-1] = (c.file_index, runs[-1][1], c.offset + c.length, c.target)
        else:
            runs.append((c.file_index, c.offset, c.offset + c.length, c.target))
    return runs


def test_an_osts_last_chunks_go_out_in_pieces_that_fill_its_depth() -> None:
    """One OST, 6 chunks of 4 MiB, 4 readers: the first 4 requests are whole chunks; the 8 MiB left are
    fewer than a chunk per reader, so they go out as 2 MiB pieces (4 of them, all in flight at once)
    instead of 2 chunks with 2 readers idle. Pieces start and end on 2 MiB boundaries (huge pages)."""
    one = Layout([Component(0, EOF_END, 4 * MiB, 1, [3])])
    chunks = cut_chunks([24 * MiB], 4 * MiB, [one])
    sched = ChunkScheduler(chunks, readers=4)
    first = [sched.take() for _ in range(4)]
    assert [c.length for c in first] == [4 * MiB] * 4
    for c in first:
        sched.done(c)
    tail = [sched.take() for _ in range(4)]
    assert [(c.offset, c.length) for c in tail] == [(16 * MiB + i * 2 * MiB, 2 * MiB) for i in range(4)]
    assert all(c.target == "ost3" for c in tail) and sched._pick() is None and sched._left == 0
    assert covered(first + tail) == covered(chunks)


def test_tail_pieces_shrink_with_what_is_left_but_not_below_2_mib() -> None:
    """16 MiB stripes, 4 readers: a request takes the OST's pending bytes shared by its depth, rounded up
    to 2 MiB (64 MiB pending: a whole chunk; 48: 12 MiB; ...); the last four are 2 MiB, ending together."""
    one = Layout([Component(0, EOF_END, 16 * MiB, 1, [0])])
    chunks = cut_chunks([64 * MiB], 16 * MiB, [one])
    order = ChunkScheduler(chunks, readers=4).order()
    assert [(c.offset // MiB, c.length // MiB) for c in order] == [
        (0, 16), (16, 12), (28, 4), (32, 8), (40, 6), (46, 2), (48, 4), (52, 4), (56, 2), (58, 2), (60, 2), (62, 2)]
    assert covered(order) == covered(chunks)


def test_without_lustre_chunks_are_never_cut_in_pieces() -> None:
    chunks = cut_chunks([24 * MiB], 4 * MiB)
    assert ChunkScheduler(chunks, readers=16).order() == chunks


def test_readers_move_to_the_osts_that_still_have_work() -> None:
    """8 readers over 2 OSTs: 4 each while both have chunks; once OST 1's are all taken, OST 0 may have
    all 8 in flight (an OST needs many requests in flight to reach its ceiling)."""
    one = Layout([Component(0, 1 << 63, MiB, 1, [0])])
    other = Layout([Component(0, 1 << 63, MiB, 1, [1])])
    chunks = cut_chunks([16 * MiB, 2 * MiB], MiB, [one, other])
    sched = ChunkScheduler(chunks, readers=8)
    first = [sched.take() for _ in range(6)]
    assert sorted(c.target for c in first) == ["ost0"] * 4 + ["ost1"] * 2  # OST 1 has only 2 chunks
    more = []
    for _ in range(4):  # OST 1 has nothing left to hand out: its share goes to OST 0
        assert sched._pick() is not None, sched._inflight  # (take() would wait for a done())
        more.append(sched.take())
    assert {c.target for c in more} == {"ost0"} and sched._inflight["ost0"] == 8
    assert sched._pick() is None  # and no further: 8 readers in all


def test_the_launchers_files_get_their_layouts_only_on_lustre(tmp_path, monkeypatch) -> None:
    """layouts_of (what the launcher's staged restore passes to StageJob): off Lustre nothing is asked;
    on Lustre each file's `lfs getstripe` (a stand-in `lfs` printing the documented output: no Lustre here)."""
    from mxlaunch.staging import lustre

    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for f in files:
        f.write_bytes(b"x")
    fake = tmp_path / "bin" / "lfs"
    fake.parent.mkdir()
    (tmp_path / "out.txt").write_text(PLAIN_MULTI)
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\ncat {tmp_path}/out.txt\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{__import__('os').environ['PATH']}")
    assert lustre.layouts_of(files) is None and not (tmp_path / "calls").exists()  # tmp is not Lustre
    monkeypatch.setattr(lustre, "is_on_lustre", lambda path: True)
    layouts = lustre.layouts_of(files)
    assert layouts is not None and [sorted(lay.ost_set) for lay in layouts] == [[0, 5, 6, 7]] * 2
    assert (tmp_path / "calls").read_text().split() == ["getstripe", str(files[0]), "getstripe", str(files[1])]


def test_readers_left_to_mxlaunch_keep_every_ost_deep() -> None:
    """READERS_PER_OST for each OST the files sit on, never fewer than the default, at most MAX_READERS;
    off Lustre the default stands."""
    multi = parse_getstripe(PLAIN_MULTI)  # OSTs 0, 5, 6, 7
    assert readers_for_layouts(32, None) == 32 and readers_for_layouts(32, [None, None]) == 32
    assert readers_for_layouts(32, [multi]) == READERS_PER_OST * 4 == 64
    assert readers_for_layouts(64, [multi]) == 64  # the default already covers them
    spread = [Layout([Component(0, EOF_END, 4 << 20, 4, [i + k for k in range(4)])]) for i in range(0, 8, 4)]
    assert readers_for_layouts(32, spread) == READERS_PER_OST * 8 == 128
    wide = [Layout([Component(0, EOF_END, 4 << 20, 1, [i])]) for i in range(40)]
    assert readers_for_layouts(32, wide) == MAX_READERS
    assert readers_for_layouts(200, wide) == 200  # more than the cap was asked for: kept


@pytest.mark.parametrize("write_mode", ["mmap", "pwrite"])
def test_a_stage_with_tail_pieces_completes_every_file_exactly(tmp_path, write_mode: str) -> None:
    """The real reader (no model) on Lustre layouts: an OST's last chunks come in 2 MiB pieces, and a
    file is complete when all its bytes are in, however they were cut."""
    import os

    from mxlaunch.staging.reader import StageJob
    from mxlaunch.staging.sources import CopyItem

    layouts = [Layout([Component(0, EOF_END, 4 * MiB, 1, [3])]), Layout([Component(0, EOF_END, 4 * MiB, 1, [3])])]
    sizes = [24 * MiB, 6 * MiB + 4096]
    order = ChunkScheduler(cut_chunks(sizes, 16 * MiB, layouts), readers=4).order()
    assert any(c.length == 2 * MiB for c in order)  # pieces are really handed out here
    items = []
    for i, size in enumerate(sizes):
        src = tmp_path / "src" / f"f{i}.bin"
        src.parent.mkdir(exist_ok=True)
        src.write_bytes(os.urandom(size))
        items.append(CopyItem(src=src, rel=src.name, size=size))
    result = StageJob(items, tmp_path / "dst", readers=4, chunk_size=16 * MiB, layouts=layouts, use_o_direct=False,
                      write_mode=write_mode).start().wait()
    assert [f.rel for f in result.files] == ["f0.bin", "f1.bin"]
    for item in items:
        assert (tmp_path / "dst" / item.rel).read_bytes() == item.src.read_bytes()
