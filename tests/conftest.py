"""Shared test wiring: every test gets its marker from the folder it lives in."""

from __future__ import annotations

from pathlib import Path

import pytest

_MARKER_BY_FOLDER = {"unit": "unit", "e2e": "e2e", "slurm": "slurm", "redis": "redis"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        marker = _MARKER_BY_FOLDER.get(folder)
        if marker:
            item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(autouse=True, scope="session")
def _kernel_caches_in_the_session_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Launches in tests restore and capture JIT kernel caches in the session's tmp folder, never in the
    user's ~/.cache (a test that wants its own sets MXLAUNCH_KERNEL_CACHE_DIR itself)."""
    import os

    os.environ.setdefault("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
