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
    """script → the other scripts it imports (they import each other by bare name, their kind folder of scripts/
    put on sys.path: scripts/bench/gpu_shapes.py is `gpu_shapes` wherever it is imported from)."""
    paths = sorted((ROOT.parent / "scripts").rglob("*.py"))
    names = {p.stem: p for p in paths}
    assert len(names) == len(paths), "two scripts of one name: a bare-name import could not tell them apart"
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
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


def _with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph plus the package edge: importing `mxlaunch.a.b` runs `mxlaunch/a/__init__.py` first, so a module
    that imports anything in package `a` depends on `mxlaunch.a` (an __init__ that imports its submodules, which
    import a sibling, is a circle through the package)."""
    def packages(dep: str) -> set[str]:
        parts = dep.split(".")
        return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}

    return {module: {p for d in deps for p in packages(d) if p in graph and p != module} for module, deps in graph.items()}


# Edges the test leaves out, each with its owner and why; whoever removes the arrow removes its line.
ALLOWED_CIRCLE_EDGES: set[tuple[str, str]] = set()  # none left (the snapshot signal protocol is contract.py's)


def test_no_import_circle() -> None:
    graph = _with_packages(_graph())  # holds every edge of _graph(): a circle there is one here
    assert "mxlaunch.store" in graph["mxlaunch.store.prune"]  # the package edge is there
    for module, dep in ALLOWED_CIRCLE_EDGES:
        graph.get(module, set()).discard(dep)
    assert _cycles(graph) == []


def _importers(graph: dict[str, set[str]], lower: str, upper: str) -> set[tuple[str, str]]:
    """The arrows from a module under `lower` to one under `upper`."""
    return {(m, d) for m, deps in graph.items() if m.startswith(lower + ".") or m == lower
            for d in deps if d.startswith(upper + ".") or d == upper}


# the launcher's one arrow into the plugin, the lead's (issue 43: the signal protocol moves below both sides)
ALLOWED_LAUNCH_TO_PLUGIN: set[tuple[str, str]] = set()  # the launcher and the plugin share mxlaunch/contract.py


def test_arrows_point_down() -> None:
    """The download layer gets what to fetch, not an engine's argv; the store owns what it prunes, never reaching
    up into the launcher; the launcher and the in-engine plugin share protocols from below both."""
    graph = _graph()
    assert _importers(graph, "mxlaunch.remote", "mxlaunch.engines") == set()
    assert _importers(graph, "mxlaunch.store", "mxlaunch.launch") == set()
    assert _importers(graph, "mxlaunch.launch", "mxlaunch.plugin") <= ALLOWED_LAUNCH_TO_PLUGIN
    assert _importers(graph, "mxlaunch.plugin", "mxlaunch.staging") == set()
    assert graph["mxlaunch.memory.hugepages"] == set()  # the page helpers both sides share stand on nothing of ours
    assert _importers(graph, "mxlaunch.launch", "mxlaunch.cli") == set()
    # warm start-up state (mxlaunch/warmstart/__init__.py): its in-engine half shares contract.py, never an import
    assert _importers(graph, "mxlaunch.warmstart", "mxlaunch.plugin") == set()
    assert _importers(graph, "mxlaunch.plugin", "mxlaunch.warmstart") == set()
    assert _importers(graph, "mxlaunch.store", "mxlaunch.warmstart") == set()
    assert _importers(graph, "mxlaunch.warmstart", "mxlaunch.launch") == set()  # its log files: safety/logfile.py


def test_no_import_circle_among_the_scripts() -> None:
    graph = _script_graph()
    assert graph["bench_gpu_two_ranks"] == {"gpu_shapes"}  # the graph sees the scripts' imports
    assert _cycles(graph) == []


def test_no_script_needs_the_test_suite() -> None:
    """A benchmark or probe runs without pytest: no script imports a test module (tests/helpers is plain code)."""
    def imported(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        return found

    scripts = sorted((ROOT.parent / "scripts").rglob("*.py"))
    assert any(m.startswith("tests.helpers") for p in scripts for m in imported(p))  # it sees imports of tests/
    bad = {p.name: m for p in scripts for m in imported(p) if m == "pytest" or m.startswith(("tests.unit", "tests.e2e"))}
    assert bad == {}


SCRIPT_KINDS = {"bench", "probes", "kits", "services"}  # issue 43: scripts sorted by kind, each named in the README
SCRIPTS_AT_TOP = {"demo.py"}  # the README's demo (`make demo`): what a new reader runs first, so it stays in sight


def test_every_script_lives_in_the_folder_of_its_kind() -> None:
    scripts = ROOT.parent / "scripts"
    entries = [p for p in scripts.iterdir() if p.name != "__pycache__"]
    assert {p.name for p in entries if not p.is_dir()} == SCRIPTS_AT_TOP, "a loose script: move it into its kind's folder"
    assert {p.name for p in entries if p.is_dir()} == SCRIPT_KINDS, "a new kind of script: name it in README's layout"
    for kind in sorted(SCRIPT_KINDS):
        files = [p for p in (scripts / kind).iterdir() if p.name != "__pycache__"]
        assert files and all(p.is_file() for p in files), f"scripts/{kind}/ is empty or nested"
    assert all(p.name.startswith("probe_") for p in (scripts / "probes").glob("*.py"))
    readme = (ROOT.parent / "README.md").read_text()
    assert [k for k in sorted(SCRIPT_KINDS) if f"`scripts/{k}/`" not in readme] == [], "README's layout names each kind"


def test_the_top_level_holds_only_what_every_side_shares_and_every_package_says_what_it_owns() -> None:
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT.parent)} has no docstring saying what the package owns"


MAX_LINES = 400  # issue 43: a module over this holds more than one job; split it along them
# Generated option tables: one line per engine flag, rewritten by their generator (their docstrings say so).
GENERATED = {"engines/vllm_flags.py": "scripts/kits/gen_vllm_flags.py", "engines/sglang_flags.py": "scripts/kits/gen_sglang_flags.py"}
# Still over, each with its owner; whoever splits one removes its line (the test fails on a line left behind).
ALLOWED_LONG: set[str] = set()  # none left (issue 43): every module is under 400 lines


def test_no_module_over_400_lines() -> None:
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    for name, generator in GENERATED.items():
        assert f"generated by {generator}" in (ROOT / name).read_text(), f"{name} no longer says it is generated"
    over = {name for name, n in lines.items() if n > MAX_LINES and name not in GENERATED}
    assert over - ALLOWED_LONG == set(), {name: lines[name] for name in over - ALLOWED_LONG}
    assert ALLOWED_LONG - over == set(), "under 400 lines now: remove them from ALLOWED_LONG"
