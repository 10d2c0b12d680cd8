"""The live tests' setup (SGLang's venv, the CRIU kit) runs beside the first live tests, not before them.

scripts/services/run_tests.sh starts `MXLAUNCH_LIVE_SETUP` in the background and names, in
`MXLAUNCH_LIVE_SETUP_STATUS`, the file its exit code will land in (written whole: temp file + rename).
Tests that need what it builds carry `@pytest.mark.live_setup`: tests/conftest.py runs them last and waits
here before each one's fixtures start, so none of them can see a half-built venv — they wait, never skip.
Without the variable (pytest run by hand) nothing runs in the background and there is nothing to wait for.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, MutableMapping, Optional

STATUS_ENV = "MXLAUNCH_LIVE_SETUP_STATUS"
REPO = Path(__file__).resolve().parents[2]
CRIU_KIT = REPO / ".criu4-kit" / "run.sh"
# counted from the first wait, when the live run has nothing else left to run: the niced setup then has the cores
# (alone it takes ~2.5 min on the 2-core VM); a stuck one fails here, before the live tests' 900 s deadline
WAIT_S = 840.0


_marked: Optional[bool] = None  # whether the running test is marked `live_setup`; None outside a pytest test


def entered(marked: bool) -> None:
    """tests/conftest.py, before each test's fixtures: whether what the setup builds may be used."""
    global _marked
    _marked = marked


def require(what: str) -> None:
    """Called where the setup's products are used: a test that uses one unmarked would race the install."""
    if _marked is False:
        raise AssertionError(f"{what} needs the live setup — mark the test @pytest.mark.live_setup "
                             "(tests/helpers/live_setup.py)")


class LiveSetupFailed(RuntimeError):
    """The background setup exited non-zero or never finished: the tests that need it fail with this."""


def wait_for_live_setup(environ: MutableMapping[str, str] = os.environ, *, timeout_s: float = WAIT_S,
                        poll_s: float = 0.5, sleep: Callable[[float], None] = time.sleep,
                        clock: Callable[[], float] = time.monotonic) -> None:
    """Returns once the setup exited 0 (at once without one); raises LiveSetupFailed otherwise. Then points
    `MXLAUNCH_CRIU` at the kit the setup built, unless the caller named one."""
    status = environ.get(STATUS_ENV)
    if status:
        path = Path(status)
        deadline = clock() + timeout_s
        while not path.exists():
            if clock() >= deadline:
                raise LiveSetupFailed(f"the live tests' setup has not finished after {timeout_s:.0f} s "
                                      f"(no {path}) — see its output above the live tests' log")
            sleep(poll_s)
        code = path.read_text().strip()
        if code != "0":
            raise LiveSetupFailed(f"the live tests' setup exited {code or '?'} — see its output above the live "
                                  "tests' log (make .venv-sglang/.mxlaunch-installed criu-kit)")
    point_at_criu_kit(environ)


def point_at_criu_kit(environ: MutableMapping[str, str]) -> None:
    """The CRIU kit `make criu-kit` built, for launches with --zygote / --engine-snapshot, unless named."""
    if not environ.get("MXLAUNCH_CRIU") and os.access(CRIU_KIT, os.X_OK):
        environ["MXLAUNCH_CRIU"] = str(CRIU_KIT)
