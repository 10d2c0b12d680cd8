"""The OST model (staging/ost_model.py): where each byte lives by real `lfs getstripe` layouts, the curve,
processor sharing under the link's cap — checked on its own arithmetic, never on how long a run took —
and a real StageJob through it: byte-exact copies, and every byte counted on the OST its layout names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mxlaunch.staging.lustre import Component, Layout, parse_getstripe
from mxlaunch.staging.ost_model import MDT, OstCurve, OstModel, _Part
from mxlaunch.staging.reader import StageJob
from mxlaunch.staging.sources import CopyItem
from mxlaunch.staging.lustre_samples import PFL_PLAIN, PLAIN_MULTI, PLAIN_SINGLE

pytestmark = pytest.mark.unit
MiB = 1 << 20


def test_the_curve_grows_with_requests_in_flight_up_to_the_ceiling() -> None:
    curve = OstCurve(ceiling_bps=800e6, n_half=4)
    assert curve.bandwidth(0) == 0 and curve.bandwidth(4) == pytest.approx(400e6)
    values = [curve.bandwidth(n) for n in (1, 2, 4, 8, 32, 64)]
    assert values == sorted(values) and values[-1] < 800e6 and values[-1] > 0.99 * 800e6


def test_bytes_are_placed_by_the_real_layouts() -> None:
    multi, pfl = parse_getstripe(PLAIN_MULTI), parse_getstripe(PFL_PLAIN)  # 4 MiB stripes on OSTs 5, 6, 7, 0
    model = OstModel([multi, pfl, None], OstCurve(1e9), link_bps=1e10)
    assert model.split(0, 0, 10 * MiB) == [("ost5", 4 * MiB), ("ost6", 4 * MiB), ("ost7", 2 * MiB)]
    assert model.split(0, 15 * MiB, 2 * MiB) == [("ost0", MiB), ("ost5", MiB)]  # across a stripe boundary
    comp = pfl.component_at(0)
    assert model.split(1, 0, MiB) == [(f"ost{comp.ost_for(0)}", MiB)]
    assert model.split(2, 0, MiB) == [("ost0", MiB)]  # no layout: one server
    dom = Layout([Component(0, MiB, MiB, 0, []), Component(MiB, 1 << 63, MiB, 1, [3])])  # Data-on-MDT, then OST 3
    over = Layout([Component(0, 1 << 63, MiB, 4, [2, 2, 5, 5])])  # overstriped: two stripes per OST
    model = OstModel([dom, over], OstCurve(1e9), link_bps=1e10)
    assert model.split(0, 0, 2 * MiB) == [(MDT, MiB), ("ost3", MiB)]
    assert model.split(1, 0, 4 * MiB) == [("ost2", 2 * MiB), ("ost5", 2 * MiB)]
    assert model.servers() == {MDT, "ost3", "ost2", "ost5"}


def test_processor_sharing_under_the_links_cap() -> None:
    curve = OstCurve(ceiling_bps=100.0, n_half=1)  # B(1) = 50, B(2) = 75
    model = OstModel([None], curve, link_bps=1000.0)
    model._parts = [_Part("ost0", 10), _Part("ost0", 10), _Part("ost1", 10)]
    model._rates()
    assert [p.rate for p in model._parts] == pytest.approx([37.5, 37.5, 50.0])  # B(2)/2 each, B(1)
    model.link_bps = 62.5  # the link gives half of what the OSTs could (125)
    model._rates()
    assert [p.rate for p in model._parts] == pytest.approx([18.75, 18.75, 25.0])
    assert model.ceiling_bps({"ost0", "ost1"}) == 62.5 and OstModel([None], curve, 1e9).ceiling_bps({"a", "b"}) == 200.0


def test_the_reachable_ceiling_goes_by_where_the_bytes_are() -> None:
    """A server's ceiling only counts for the bytes it holds: the one with the most bytes per unit of
    bandwidth, or the link, sets the best time any schedule could reach."""
    curve = OstCurve(ceiling_bps=100 * MiB)
    dom = [Layout([Component(0, MiB, MiB, 0, []), Component(MiB, 1 << 63, MiB, 1, [i])]) for i in range(4)]
    model = OstModel(dom, curve, link_bps=1000 * MiB)
    # 4 files of 9 MiB: 1 MiB each on the MDT (4 MiB there), 8 MiB on each of 4 OSTs: 36 MiB in 0.08 s
    assert model.ceiling_bps() == 500 * MiB  # five servers at their ceilings: not reachable
    assert model.ceiling_for([9 * MiB] * 4) == pytest.approx(36 * MiB / 0.08)
    even = OstModel([Layout([Component(0, 1 << 63, MiB, 2, [0, 1])])], curve, link_bps=150 * MiB)
    assert even.ceiling_for([8 * MiB]) == pytest.approx(150 * MiB)  # two OSTs would give 200: the link caps


def test_a_stage_through_the_model_is_exact_and_counts_every_byte_on_its_ost(tmp_path: Path) -> None:
    layouts = [parse_getstripe(PLAIN_MULTI), parse_getstripe(PLAIN_SINGLE)]
    sizes = [9 * MiB + 4096, 3 * MiB]
    items = []
    for i, size in enumerate(sizes):
        src = tmp_path / "src" / f"f{i}.bin"
        src.parent.mkdir(exist_ok=True)
        src.write_bytes(os.urandom(size))
        items.append(CopyItem(src=src, rel=src.name, size=size))
    model = OstModel(layouts, OstCurve(ceiling_bps=400 * MiB, n_half=2), link_bps=2000 * MiB)
    result = StageJob(items, tmp_path / "dst", readers=8, chunk_size=4 * MiB, layouts=layouts, ost_model=model,
                      use_o_direct=False).start().wait()
    assert result.bytes == sum(sizes)
    for item in items:
        assert (tmp_path / "dst" / item.rel).read_bytes() == item.src.read_bytes()
    expected: dict[str, int] = {}
    for index, size in enumerate(sizes):
        for server, n in model.split(index, 0, size):
            expected[server] = expected.get(server, 0) + n
    got = {server: st.bytes for server, st in model.stats.items()}
    assert got.keys() == expected.keys() and all(abs(got[s] - expected[s]) < 1 for s in expected), (got, expected)


def test_a_part_that_ends_between_wakeups_stops_sharing_its_ost_at_its_own_end() -> None:
    """Time moves from one part's end to the next, however late the threads look: two requests on one
    OST (B(1) = 50, B(2) = 75: 37.5 each); the first ends at 1 s, the second then runs alone at 50 and
    ends at 1.75 s — even when nobody looks before 3 s."""
    model = OstModel([None], OstCurve(ceiling_bps=100.0, n_half=1), link_bps=1e9)
    model.t0 = model._last = 0.0
    first, second = _Part("ost0", 37.5), _Part("ost0", 75.0)
    model._parts = [first, second]
    model._rates()
    model._advance(3.0)
    st = model.stats["ost0"]
    assert first.left == 0 and second.left == 0 and st.bytes == pytest.approx(112.5)
    assert st.busy_s == pytest.approx(1.75) and st.inflight_s == pytest.approx(2 * 1.0 + 1 * 0.75)
    report = model.report(2.0)["ost0"]
    assert report["mean_in_flight"] == pytest.approx(2.75 / 1.75, abs=0.01)
    assert report["depth_timeline"][:10] == [2.0] * 10 and report["depth_timeline"][10:17] == [1.0] * 7


def test_a_long_step_is_spread_over_the_timeline_buckets_it_spans() -> None:
    model = OstModel([None], OstCurve(ceiling_bps=100.0, n_half=1), link_bps=1e9, bucket_s=0.5)
    model.t0 = model._last = 0.0
    model._parts = [_Part("ost0", 50.0)]  # alone: 50 per second for 1 s, no event in between
    model._rates()
    model._advance(1.0)
    assert model.report(1.0)["ost0"]["timeline"] == [0.5, 0.5, 0.0]  # 25 bytes in each 0.5 s: half of C·0.5


def test_a_failed_copy_leaves_no_request_in_the_model() -> None:
    model = OstModel([parse_getstripe(PLAIN_MULTI)], OstCurve(ceiling_bps=1e9), link_bps=1e10)
    with pytest.raises(OSError):
        with model.transfer(0, 0, 8 * MiB):
            assert len(model._parts) == 2  # two stripes, two OSTs
            raise OSError("copy failed")
    assert model._parts == []
