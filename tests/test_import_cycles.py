"""No import cycle anywhere in ``src/moewire`` (the project's style guide: "No import cycles,
also not inside a package: a shared type gets its own module below both users").

Read with ``ast`` from the sources, imports inside functions included (a lazy import is a
cycle too, only hidden until the call). ``from P import x`` is an edge to ``P.x`` when that
is a module, else to ``P``. A package's ``__init__`` is the package's node; importing a
submodule does not add an edge to its package (Python runs the package first, but a
package that imports its own submodule is no cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import moewire
from import_graph import find_cycle

ROOT = Path(moewire.__file__).parent


def _modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (packages by ``__init__``)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("moewire", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.add(sub if sub in known else base)
    edges = set()
    for name in names:
        # `import moewire.a.b` imports the deepest known module on that path.
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.add(name)
    return edges


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def test_the_cycle_finder_finds_the_old_vllm_cycle():
    """An earlier shape: vllm.py imported ``_parallel`` from vllm_worker.py
    (inside a method), which imports vllm.py."""
    old = {
        "moewire.integrations.vllm": {"moewire.integrations.vllm_worker"},
        "moewire.integrations.vllm_worker": {"moewire.integrations.vllm"},
    }
    assert find_cycle(old) == [
        "moewire.integrations.vllm", "moewire.integrations.vllm_worker",
        "moewire.integrations.vllm",
    ]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_lazy_imports_and_from_imports_are_edges():
    graph = _graph()
    # A lazy import (inside a function) is an edge: api is imported inside vllm.py's calls.
    assert "moewire.megamoe.api" in graph["moewire.integrations.vllm"]
    # `from moewire.megamoe import resum` names the submodule.
    assert "moewire.megamoe.resum" in graph["moewire.megamoe"]


def test_no_import_cycle_in_src():
    cycle = find_cycle(_graph())
    assert cycle is None, f"import cycle in src/moewire: {' -> '.join(cycle)}"
