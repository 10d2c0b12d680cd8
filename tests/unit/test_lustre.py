"""Lustre layouts from `lfs getstripe` text (written from Lustre's documented output formats, since
Lustre cannot be installed here) and the read schedule they produce."""

from __future__ import annotations

import pytest

from mxlaunch.staging.lustre import EOF_END, Component, Layout, parse_getstripe
from mxlaunch.staging.schedule import LOCAL_TARGET, MAX_READERS, READERS_PER_OST, ChunkScheduler, cut_chunks, readers_for_layouts

MiB = 1 << 20

# `lfs getstripe FILE` for a plain file striped over 4 OSTs (Lustre 2.x plain output).
PLAIN_MULTI = """\
/lustre/store/model-00001-of-00004.safetensors
lmm_stripe_count:  4
lmm_stripe_size:   4194304
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 5
\tobdidx\t\t objid\t\t objid\t\t group
\t     5\t      71329124\t    0x4406a64\t             0
\t     6\t      71330311\t    0x4406f07\t             0
\t     7\t      71324917\t    0x44059f5\t             0
\t     0\t      71331502\t    0x44073ae\t             0
"""

PLAIN_SINGLE = """\
/lustre/store/config.json
lmm_stripe_count:  1
lmm_stripe_size:   1048576
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 3
\tobdidx\t\t objid\t\t objid\t\t group
\t     3\t       1245611\t     0x1301ab\t             0
"""

# `lfs getstripe -y FILE` for the same kind of file (YAML).
YAML_MULTI = """\
lmm_stripe_count:  2
lmm_stripe_size:   1048576
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 1
lmm_objects:
      - l_ost_idx: 1
        l_fid:     0x100010000:0x2a:0x0
      - l_ost_idx: 2
        l_fid:     0x100020000:0x2b:0x0
"""

# A PFL composite file: 1 stripe for the first 4 MiB, 2 up to 64 MiB, 4 to EOF (plain output).
PFL_PLAIN = """\
/lustre/store/model.safetensors
  lcm_layout_gen:    3
  lcm_mirror_count:  1
  lcm_entry_count:   3
    lcme_id:             1
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   4194304
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 0
      lmm_objects:
      - 0: { l_ost_idx: 0, l_fid: [0x100000000:0x2:0x0] }

    lcme_id:             2
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 4194304
    lcme_extent.e_end:   67108864
      lmm_stripe_count:  2
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 1
      lmm_objects:
      - 0: { l_ost_idx: 1, l_fid: [0x100010000:0x2:0x0] }
      - 1: { l_ost_idx: 2, l_fid: [0x100020000:0x2:0x0] }

    lcme_id:             3
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 67108864
    lcme_extent.e_end:   EOF
      lmm_stripe_count:  4
      lmm_stripe_size:   4194304
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 3
      lmm_objects:
      - 0: { l_ost_idx: 3, l_fid: [0x100030000:0x3:0x0] }
      - 1: { l_ost_idx: 4, l_fid: [0x100040000:0x3:0x0] }
      - 2: { l_ost_idx: 5, l_fid: [0x100050000:0x3:0x0] }
      - 3: { l_ost_idx: 6, l_fid: [0x100060000:0x3:0x0] }
"""

# The same PFL layout as `lfs getstripe -y`; the last component not instantiated yet (small file).
PFL_YAML = """\
  lcm_layout_gen:    2
  lcm_mirror_count:  1
  lcm_entry_count:   2
  component0:
    lcme_id:             1
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   4194304
    sub_layout:
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 0
      lmm_objects:
      - l_ost_idx: 0
        l_fid:     0x100000000:0x2:0x0
  component1:
    lcme_id:             2
    lcme_mirror_id:      0
    lcme_flags:          0
    lcme_extent.e_start: 4194304
    lcme_extent.e_end:   EOF
    sub_layout:
      lmm_stripe_count:  4
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: -1
"""


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
    assert sorted(order, key=lambda c: c.offset) == sorted(chunks, key=lambda c: c.offset)
    per_target: dict[str, list[int]] = {}
    for chunk in order:
        per_target.setdefault(chunk.target, []).append(chunk.offset)
    assert set(per_target) == {f"ost{n}" for n in range(7)}
    assert all(offsets == sorted(offsets) for offsets in per_target.values())
    # The first 7 requests cover all 7 OSTs instead of queueing on OST 0's 4 chunks first.
    assert {c.target for c in order[:7]} == set(per_target)


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
    assert readers_for_layouts(32, [multi]) == 32  # 4 OSTs × 8: the default already covers them
    spread = [Layout([Component(0, EOF_END, 4 << 20, 4, [i + k for k in range(4)])]) for i in range(0, 16, 4)]
    assert readers_for_layouts(32, spread) == READERS_PER_OST * 16 == 128
    wide = [Layout([Component(0, EOF_END, 4 << 20, 1, [i])]) for i in range(40)]
    assert readers_for_layouts(32, wide) == MAX_READERS
    assert readers_for_layouts(200, wide) == 200  # more than the cap was asked for: kept
