"""The import graph of ``src/moewire`` and the cycle finder the import tests share
(tests/test_import_cycles.py, tests/reference/test_reference_imports.py).

Read with ``ast`` from the sources, imports inside functions included (a lazy import is an
edge too, only hidden until the call). ``from P import x`` is an edge to ``P.x`` when that
is a module, else to ``P``. A package's ``__init__`` is the package's node; importing a
submodule does not add an edge to its package (Python runs the package first, but a
package that imports its own submodule is no cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import moewire

ROOT = Path(moewire.__file__).parent


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (packages by ``__init__``)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("moewire", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (source file ``path``) imports."""
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


def src_graph() -> dict[str, set[str]]:
    """``{module: modules of moewire it imports}`` for every module of ``src/moewire``."""
    found = modules()
    return {m: imports(m, p, set(found)) for m, p in found.items()}
