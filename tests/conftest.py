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
