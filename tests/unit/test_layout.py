"""The house rules that code review keeps forgetting: no import circle among mxlaunch's modules or among the
scripts; few modules at mxlaunch's top level (everything else lives in a package named for its job); every
package says in its docstring what it owns."""

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


def _script_graph() -> dict[str, set[str]]:
    """script → the other scripts it imports (they import each other by bare name from scripts/)."""
    scripts = ROOT.parent / "scripts"
    names = {p.stem for p in scripts.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((scripts / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

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
    return cycles


def test_no_import_circle() -> None:
    assert _cycles(_graph()) == []


def test_no_import_circle_among_the_scripts() -> None:
    graph = _script_graph()
    assert graph["bench_gpu_two_ranks"] == {"gpu_shapes"}  # the graph sees the scripts' imports
    assert _cycles(graph) == []


def test_the_top_level_holds_only_what_every_side_shares_and_every_package_says_what_it_owns() -> None:
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT.parent)} has no docstring saying what the package owns"
