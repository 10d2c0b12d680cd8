"""Shared test wiring: every test gets its marker from the folder it lives in; `redis_url` is a real redis-server."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

# As in an activated environment: the engines' console scripts (vllm) resolve on PATH to this Python's,
# so that launch plans read the engine's version where the engine runs (mxlaunch/engines/runtime.py).
_BIN = os.path.dirname(sys.executable)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join(p for p in (_BIN, os.environ.get("PATH", "")) if p)

_MARKER_BY_FOLDER = {"unit": "unit", "e2e": "e2e", "slurm": "slurm", "redis": "redis"}
# A live test starts real engines (one or two vLLM/SGLang starts of ~30-60 s each, up to their own deadlines):
# its pytest-timeout deadline, where the test names none itself (the unit default is pyproject's `timeout`).
LIVE_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # what needs the live setup (SGLang's venv, CRIU) runs last, while the setup finishes beside the rest;
    # a stable sort keeps each module's tests together and in order (its module fixtures start once)
    items.sort(key=lambda item: item.get_closest_marker("live_setup") is not None)
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        marker = _MARKER_BY_FOLDER.get(folder)
        if marker:
            item.add_marker(getattr(pytest.mark, marker))
        if marker in ("e2e", "slurm", "redis") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LIVE_TIMEOUT_S))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a `live_setup` test's fixtures start (an SGLang server among them): the setup has finished."""
    from tests.helpers import live_setup

    marked = item.get_closest_marker("live_setup") is not None
    live_setup.entered(marked)
    if marked:
        try:
            live_setup.wait_for_live_setup()
        except live_setup.LiveSetupFailed as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _kernel_caches_in_the_session_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Launches in tests restore and capture JIT kernel caches in the session's tmp folder, never in the
    user's ~/.cache (a test that wants its own sets MXLAUNCH_KERNEL_CACHE_DIR itself)."""
    import os

    os.environ.setdefault("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server for the session (scripts/services/start_redis.sh) with a random `requirepass`, as
    `redis://:PASSWORD@127.0.0.1:PORT/0`.
    Tests that use it are marked `redis`; each one flushes the database it needs."""
    from tests.helpers.redis_server import redis_session

    folder = tmp_path_factory.mktemp("redis")
    try:
        yield from redis_session(folder)
    except RuntimeError as exc:
        pytest.fail(str(exc))
