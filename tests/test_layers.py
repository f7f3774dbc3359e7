"""Imports go one way (docs/DESIGN.md, "Layers"): import-linter's contracts, and no cycle among any modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_linter_contracts_hold() -> None:
    # in a process of its own: lint-imports reconfigures logging (disabling the loggers that exist)
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's components of more than one module (or a module importing itself): the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def imports_inside_functions() -> set[tuple[str, int]]:
    """(module, line) of every import of the package made inside a function of the package."""
    found = set()
    for path in (ROOT / "veloxpatch").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    relative = isinstance(node, ast.ImportFrom) and node.level > 0
                    named = isinstance(node, (ast.Import, ast.ImportFrom)) and "veloxpatch" in ast.unparse(node)
                    if relative or named:
                        found.add((module, node.lineno))
    return found


def test_no_module_is_part_of_an_import_cycle_counting_imports_inside_functions() -> None:
    graph = grimp.build_graph("veloxpatch", cache_dir=None)
    lines = {(d["importer"], d["line_number"]) for m in graph.modules
             for o in graph.find_modules_directly_imported_by(m)
             for d in graph.get_import_details(importer=m, imported=o)}
    inside = {(m, line) for m, line in imports_inside_functions() if m in graph.modules}  # _shim is no module
    assert inside and inside <= lines, f"the graph misses imports made inside functions: {sorted(inside - lines)}"
    assert strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_package_and_its_module() -> None:
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "q"):
        graph.add_module(module)
    graph.add_import(importer="p", imported="p.a")
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p")
    graph.add_import(importer="q", imported="p")
    assert strongly_connected(graph) == [["p", "p.a", "p.b"]]
