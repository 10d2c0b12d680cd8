"""The launcher ↔ plugin contract and the settings table: one definition each, kept honest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mxlaunch import contract, settings
from mxlaunch.engines.base import mxlaunch_events

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_loaded_line_round_trips_through_its_regex() -> None:
    line = contract.loaded_line(3, 5 << 30, 1.234)
    assert line == "mxlaunch: rank 3 loaded 5.00 GiB in 1.23 s (strategy staged)"
    m = contract.LOADED_LINE.search("(Worker pid=1) INFO 11-30 10:00:00 [x.py:1] " + line)
    assert m and m.group(1) == "3" and float(m.group(3)) == 1.23 and m.group(4) == "staged"
    [ev] = mxlaunch_events(line)
    assert (ev.name, ev.rank, ev.seconds) == ("weight_loading", "rank3", 1.23)


def test_staged_line_round_trips_through_its_regex() -> None:
    line = contract.staged_line(3 << 29, 2.5)
    assert contract.STAGED_LINE.search(line).groups() == ("1.50", "2.50")


def test_marker_names() -> None:
    assert contract.marker_name(contract.LOADED, 7) == "loaded-7.json"
    assert contract.parse_marker_name(Path("/x/captured-12.json")) == ("captured", 12)
    assert contract.parse_marker_name(Path("/x/abort.json")) is None
    assert contract.parse_marker_name(Path("/x/other-1.json")) is None


def test_every_variable_read_in_the_code_is_in_settings() -> None:
    used = set()
    for path in (ROOT / "mxlaunch").rglob("*.py"):
        used |= set(re.findall(r"MXLAUNCH_[A-Z_]+", path.read_text()))
    used -= {"MXLAUNCH_LOADED", "MXLAUNCH_STAGED"}  # regex names, not variables
    assert used <= set(settings.VARIABLES), sorted(used - set(settings.VARIABLES))
    outside = [p for p in (ROOT / "mxlaunch").rglob("*.py")
               if p.name != "settings.py" and re.search(r"environ(?:\.get)?\(?\[?[\"']MXLAUNCH_", p.read_text())]
    assert outside == []  # every module reads them through settings


def test_every_variable_is_documented() -> None:
    text = (ROOT / "docs" / "engines.md").read_text()
    assert [v for v in settings.VARIABLES if f"`{v}`" not in text] == []


def test_a_p2p_loaded_line_gives_the_profile_a_p2p_phase_inside_weight_loading() -> None:
    from pathlib import Path

    from mxlaunch.profile.profiler import profile_text

    line = contract.loaded_line(0, 1 << 30, 0.42, strategy="p2p")
    events = mxlaunch_events(line)
    assert {(e.name, e.seconds) for e in events} == {("weight_loading", 0.42), ("p2p", 0.42)}
    log = (Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "vllm-0.32-cpu-tiny-llama.log").read_text()
    lines = log.splitlines()
    at = next(i for i, text in enumerate(lines) if "Loading weights took" in text)
    prefix = lines[at].split("[")[0]  # the engine's own prefix and timestamp
    run = profile_text("\n".join(lines[:at] + [prefix + line] + lines[at:]), engine="vllm")
    assert run.seconds("p2p") == 0.42
    assert run.seconds("weight_loading") >= 0.42  # the pull is inside the weight phase
