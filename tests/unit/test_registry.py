"""The engine registry: every engine answers the whole protocol, and the callers never name one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mxlaunch.engines.protocol import Engine
from mxlaunch.engines.registry import ENGINES, detect, engine_for
from mxlaunch.errors import UsageError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2] / "mxlaunch"


def test_every_engine_answers_the_protocol() -> None:
    members = [n for n in vars(Engine) if not n.startswith("_")] + list(Engine.__annotations__)
    for name, engine in ENGINES.items():
        assert engine.name == name
        missing = [m for m in members if not hasattr(engine, m)]
        assert missing == [], (name, missing)


@pytest.mark.parametrize("argv, name", [
    (["vllm", "serve", "/m"], "vllm"),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], "vllm"),
    (["python", "-m", "sglang.launch_server", "--model-path", "/m"], "sglang"),
    (["sglang", "serve", "/m"], "sglang"),
    (["bash", "run.sh"], None),
])
def test_detect(argv: list[str], name: str | None) -> None:
    found = detect(argv)
    assert (found.name if found else None) == name


def test_unknown_command_lists_every_form() -> None:
    with pytest.raises(UsageError) as err:
        engine_for(["torchrun", "x.py"])
    assert all(e.command_forms in err.value.fix for e in ENGINES.values())


def _code(path: Path) -> str:
    """The module without comments and docstrings (they may name engines; code may not)."""
    text = re.sub(r'(?s)""".*?"""', "", path.read_text())
    return "\n".join(line.split("#")[0] for line in text.splitlines())


@pytest.mark.parametrize("rel", ["launch", "slurm.py", "profile/live.py", "cli"])
def test_callers_never_name_an_engine(rel: str) -> None:
    paths = sorted((ROOT / rel).rglob("*.py")) if (ROOT / rel).is_dir() else [ROOT / rel.removesuffix(".py")].copy()
    paths = [p if p.suffix == ".py" or p.is_dir() else p.with_suffix(".py") for p in paths]
    for path in paths:
        code = _code(path)
        for name in ENGINES:
            assert not re.search(rf"[\"']{name}[\"']", code), (path, name)  # no `== "vllm"`, no ENGINES["vllm"]
