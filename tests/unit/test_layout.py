"""The house rules that code review keeps forgetting: no import circle among mxlaunch's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2] / "mxlaunch"


def _graph() -> dict[str, set[str]]:
    """module → the mxlaunch modules it imports, at module level or inside functions (lazy imports too;
    not `if TYPE_CHECKING:` ones, which never run)."""
    files = {("mxlaunch." + ".".join(p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: never imported at run time
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mxlaunch"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("mxlaunch")}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_no_import_circle() -> None:
    graph, state, stack, cycles = _graph(), {}, [], []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []
