"""The imports of ``moewire.reference`` run one way: no cycle between its modules, and
nothing of moewire outside the package.

Read with ``ast`` from the sources, imports inside functions included (a lazy import is a
cycle too, only hidden until the call).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moewire.reference
from import_graph import find_cycle

PACKAGE = "moewire.reference"
ROOT = Path(moewire.reference.__file__).parent
MODULES = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")


def _imported(module: str) -> set[str]:
    """Every ``moewire...`` module ``module`` imports: ``from P import x`` counts as
    importing ``P.x`` when ``x`` is a module of this package, else as importing ``P``."""
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = PACKAGE if node.level == 1 else PACKAGE.rsplit(".", node.level - 1)[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                is_module = base == PACKAGE and alias.name in MODULES
                names.add(f"{base}.{alias.name}" if is_module else base)
    return {n for n in names if n == "moewire" or n.startswith("moewire.")}


def _graph() -> dict[str, set[str]]:
    """``{module: reference modules it imports}``; a name taken from the package itself is
    an edge to its ``__init__``, which imports every module."""
    graph = {}
    for m in MODULES:
        targets = set()
        for name in _imported(m):
            if name == PACKAGE:
                targets.add("__init__")
            elif name.startswith(PACKAGE + "."):
                head = name[len(PACKAGE) + 1 :].split(".")[0]
                if head in MODULES:
                    targets.add(head)
        graph[m] = targets
    graph["__init__"] = set(MODULES)
    return graph


def test_the_cycle_finder_finds_the_old_cycle():
    # An earlier shape: deep_gemm imported _kernel, which imported deep_gemm back.
    old = {"deep_gemm": {"_kernel", "_alloc"}, "_kernel": {"deep_gemm"}, "_alloc": set()}
    assert find_cycle(old) == ["_kernel", "deep_gemm", "_kernel"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_reference_modules_import_without_a_cycle():
    graph = _graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in moewire.reference: {' -> '.join(cycle)}"
    assert "buffer" in graph["_kernel"]  # the kernel reads the buffer, never the API


@pytest.mark.parametrize("module", MODULES)
def test_reference_imports_nothing_of_moewire_outside_it(module):
    outside = {n for n in _imported(module) if not n.startswith(PACKAGE)}
    assert not outside, f"moewire.reference.{module} imports {sorted(outside)}"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_docstring_says_what_it_may_import(module):
    doc = ast.get_docstring(ast.parse((ROOT / f"{module}.py").read_text())) or ""
    assert "May import:" in doc, f"moewire.reference.{module}: opening docstring lacks it"
