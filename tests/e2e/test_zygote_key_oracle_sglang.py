"""The zygote key's oracle for SGLang (issue 42; tests/helpers/zygote_env_oracle.py says how it works): SGLang's
imports, in .venv-sglang with the test shim, read only keyed variables. In the live lane, marked `live_setup`:
in the unit lane it raced the background install of SGLang's venv, and lost once the install took longer than
the unit tests (CI on a loaded box, session 31: "assert any(k.startswith('SGLANG_') ...)" on a half-built venv)."""

from __future__ import annotations

import pytest

from mxlaunch.engines.sglang_argv import SERVER_MODULE
from mxlaunch.engines.sglang_engine import SGLangEngine
from tests.helpers.sglang_server import sglang_python
from tests.helpers.zygote_env_oracle import SHIM, check, trace


@pytest.mark.live_setup
@pytest.mark.timeout(600)
def test_sglang_imports_read_only_keyed_variables() -> None:
    python = sglang_python()
    if not python.exists():
        pytest.fail(f"{python} missing: `make test` installs .venv-sglang")
    found = trace(python, ["mxlaunch.plugin.zygote", SERVER_MODULE, *SGLangEngine.zygote_preload],
                  {"PYTHONPATH": str(SHIM), "SGLANG_USE_CPU_ENGINE": "1"})
    assert any(k.startswith("SGLANG_") for k in found["read"])
    check(found)
