"""The imports of ``moewire.reference`` run one way: no cycle between its modules, and
nothing of moewire outside the package.

Read with ``ast`` from the sources, imports inside functions included (a lazy import is a
cycle too, only hidden until the call). Modules are named relative to the package, a
kernel family's subpackage included: ``deep_gemm``, ``nvfp4.buffer``, ``nvfp4`` (that
subpackage's ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moewire.reference
from import_graph import find_cycle

PACKAGE = "moewire.reference"
ROOT = Path(moewire.reference.__file__).parent


def _files() -> dict[str, Path]:
    """``{name relative to the package: file}``; a subpackage is named by its ``__init__``,
    the package's own ``__init__`` is left out (it is the graph's ``"__init__"``)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


FILES = _files()
MODULES = sorted(FILES)
SUBPACKAGES = sorted(m for m, p in FILES.items() if p.name == "__init__.py")


def _imported(module: str) -> set[str]:
    """Every ``moewire...`` module ``module`` imports: ``from P import x`` counts as
    importing ``P.x`` when that is a module of this package, else as importing ``P``."""
    path = FILES[module]
    own = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = f"{PACKAGE}.{own}" if own else PACKAGE
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = sub.startswith(PACKAGE + ".") and sub[len(PACKAGE) + 1 :] in FILES
                names.add(sub if is_module else base)
    return {n for n in names if n == "moewire" or n.startswith("moewire.")}


def _graph() -> dict[str, set[str]]:
    """``{module: reference modules it imports}``; a name taken from the package itself is
    an edge to its ``__init__``, which imports every module. ``import P.a.b`` is an edge to
    the deepest module on that path."""
    graph = {}
    for m in MODULES:
        targets = set()
        for name in _imported(m):
            if name == PACKAGE:
                targets.add("__init__")
            elif name.startswith(PACKAGE + "."):
                rel = name[len(PACKAGE) + 1 :]
                while rel and rel not in FILES:
                    rel = rel.rpartition(".")[0]
                if rel and rel != m:
                    targets.add(rel)
        graph[m] = targets
    graph["__init__"] = set(MODULES)
    return graph


def test_the_cycle_finder_finds_the_old_cycle():
    # An earlier shape: deep_gemm imported _kernel, which imported deep_gemm back.
    old = {"deep_gemm": {"_kernel", "_alloc"}, "_kernel": {"deep_gemm"}, "_alloc": set()}
    assert find_cycle(old) == ["_kernel", "deep_gemm", "_kernel"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_reaches_into_the_kernel_families():
    graph = _graph()
    assert "nvfp4" in SUBPACKAGES
    # `from moewire.reference.nvfp4.mega_moe import ...` names the module, not the folder.
    assert {"nvfp4.buffer", "nvfp4.mega_moe"} <= graph["deep_gemm"]
    # `from moewire.reference.nvfp4 import _numerics` names the module too.
    assert "nvfp4._numerics" in graph["nvfp4.mega_moe"]
    assert "deep_gemm" in graph["nvfp4.experts"]


def test_reference_modules_import_without_a_cycle():
    graph = _graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in moewire.reference: {' -> '.join(cycle)}"
    assert "buffer" in graph["_kernel"]  # the kernel reads the buffer, never the API


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_a_kernel_family_package_imports_nothing(package):
    # Importing any module of the family runs its __init__ first, and deep_gemm imports the
    # family's buffer and kernel: an __init__ that imported its experts module would close
    # deep_gemm -> nvfp4 -> nvfp4.experts -> deep_gemm (which loads today only because
    # experts reads deep_gemm's names at call time). The graph above draws no edge from a
    # module to its own package, so this rule is checked here.
    imported = _imported(package)
    assert not imported, f"moewire.reference.{package}/__init__ imports {sorted(imported)}"


@pytest.mark.parametrize("module", MODULES)
def test_reference_imports_nothing_of_moewire_outside_it(module):
    outside = {n for n in _imported(module) if not n.startswith(PACKAGE)}
    assert not outside, f"moewire.reference.{module} imports {sorted(outside)}"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_docstring_says_what_it_may_import(module):
    doc = ast.get_docstring(ast.parse(FILES[module].read_text())) or ""
    assert "May import:" in doc, f"moewire.reference.{module}: opening docstring lacks it"
