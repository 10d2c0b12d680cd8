"""The live setup in the background (scripts/services/run_tests.sh, tests/helpers/live_setup.py): the tests that
need it wait for its exit code and fail on a bad one, and every live test that needs it says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import live_setup
from tests.helpers.live_setup import LiveSetupFailed, wait_for_live_setup



class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_without_a_status_file_named_nothing_is_waited_for(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    clock = FakeClock()
    wait_for_live_setup(environ, sleep=clock.sleep, clock=clock)
    assert clock.now == 0


def test_it_waits_until_the_exit_code_lands_then_points_at_the_criu_kit(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    status, kit = tmp_path / "status", tmp_path / "run.sh"
    kit.write_text("#!/bin/sh\n")
    kit.chmod(0o755)
    monkeypatch.setattr(live_setup, "CRIU_KIT", kit)
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 90:
            status.write_text("0\n")

    environ = {live_setup.STATUS_ENV: str(status)}
    wait_for_live_setup(environ, sleep=sleep, clock=clock, poll_s=1.0)
    assert clock.now == 90 and environ["MXLAUNCH_CRIU"] == str(kit)
    named = {live_setup.STATUS_ENV: str(status), "MXLAUNCH_CRIU": "/opt/criu"}
    wait_for_live_setup(named, sleep=clock.sleep, clock=clock)
    assert named["MXLAUNCH_CRIU"] == "/opt/criu"  # the caller's choice stands


@pytest.mark.parametrize("code", ["2", ""])
def test_a_failed_setup_fails_the_tests_that_need_it(tmp_path: Path, code: str) -> None:
    status = tmp_path / "status"
    status.write_text(code)
    with pytest.raises(LiveSetupFailed, match="setup exited"):
        wait_for_live_setup({live_setup.STATUS_ENV: str(status)})


def test_a_setup_that_never_ends_fails_at_the_deadline(tmp_path: Path) -> None:
    clock = FakeClock()
    with pytest.raises(LiveSetupFailed, match="not finished after 60 s"):
        wait_for_live_setup({live_setup.STATUS_ENV: str(tmp_path / "status")}, timeout_s=60,
                            sleep=clock.sleep, clock=clock)
    assert clock.now == 60


def test_what_needs_the_setup_refuses_to_run_in_a_test_not_marked_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's Python, CRIU and launches that dump or restore with it: in a test without `live_setup` they
    would race the install, so they fail at once and name the fix."""
    from tests.e2e.test_zygote_image import usable_criu
    from tests.helpers.launcher import LaunchProcess
    from tests.helpers.sglang_server import sglang_python

    monkeypatch.setattr(live_setup, "_marked", False)
    for needs in (sglang_python, usable_criu,
                  lambda: LaunchProcess("m", Path("/nonexistent"), launch_args=("--zygote",))):
        with pytest.raises(AssertionError, match="@pytest.mark.live_setup"):
            needs()
    monkeypatch.setattr(live_setup, "_marked", True)
    assert sglang_python().name.startswith("python")


def test_this_test_is_known_to_be_unmarked() -> None:
    assert live_setup._marked is False  # conftest's hook told the helper, before this test's fixtures
