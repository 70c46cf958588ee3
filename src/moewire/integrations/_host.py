"""Host-neutral glue that every host integration needs (vLLM, SGLang, transformers,
ModelOpt): the one place below the host packages, which never import each other.

- :func:`rebind_global`: make a host module's global (a staging function its forward
  reads at call time) a trampoline to a global of a moewire bridge module, so that one
  experts adapter names the bridge for both the staging function and the DeepGEMM
  namespace; through the undo ledger (:mod:`moewire.patches`).
- :func:`source_reach` (:class:`SourceReach`): recognise a host module by the calls and
  imports its source makes, read from its syntax tree, never by a version.
- :data:`ENV_RECIPE`, :data:`ENV_SCALES` and :func:`rank_path`: what the plugins read, a
  scales path with ``{rank}`` replaced.
- :func:`begin_calibration` and :func:`finish_calibration`: one calibration held open on
  a host's worker or scheduler across the two calibration RPCs.
- :func:`register_host_classes`: register another host's experts classes through moewire's
  entry point group :data:`HOST_CLASSES` (ModelOpt's registration takes vLLM's classes so,
  without importing the vLLM host package).

May import: the standard library and ``moewire.patches``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from moewire import patches

#: The recipe every host's plugin quantizes with at model load (a name or a YAML path).
ENV_RECIPE = "MOEWIRE_RECIPE"
#: Saved scales the plugins load after quantizing (``{rank}``: the EP rank).
ENV_SCALES = "MOEWIRE_SCALES"
#: The entry point group where each host names the function that registers its Mega-MoE
#: experts classes with moewire and returns them (pyproject.toml).
HOST_CLASSES = "moewire.host_classes"

__all__ = [
    "ENV_RECIPE",
    "ENV_SCALES",
    "HOST_CLASSES",
    "SourceReach",
    "begin_calibration",
    "finish_calibration",
    "is_rebound",
    "rank_path",
    "rebind_global",
    "register_host_classes",
    "source_reach",
]


def _module_source(module_name: str) -> str | None:
    """The source of ``module_name``, or ``None`` when it does not import or has none."""
    try:
        return inspect.getsource(importlib.import_module(module_name))
    except (ImportError, OSError, TypeError):
        return None


def _attributes_named(value: ast.expr) -> set[str]:
    """The attribute names an expression evaluates to: ``obj.a`` gives ``{"a"}``, a
    conditional ``obj.a if c else obj.b`` gives ``{"a", "b"}``, anything else nothing."""
    if isinstance(value, ast.Attribute):
        return {value.attr}
    if isinstance(value, ast.IfExp):
        return _attributes_named(value.body) | _attributes_named(value.orelse)
    return set()


class SourceReach:
    """What a module's source does, read from its syntax tree (comments, strings and
    definitions are no calls): the names it calls, bare (``fn(...)``) and as attributes
    (``obj.fn(...)``), and the modules it imports with ``import``.

    A local name bound to attributes and then called counts as a call of each of them:
    vLLM main's ``vllm/models/common/deep_gemm_mega_moe.py`` (6dfb263) picks its kernel as
    ``kernel = deep_gemm.bf16_mega_moe if ... else deep_gemm.fp8_fp4_mega_moe`` and calls
    ``kernel(...)``. A name bound but never called is no call. Modules named in ``from X
    import ...`` (absolute) are kept apart from those of ``import X`` (:attr:`from_imports`):
    a name imported from a module is bound at import, not looked up on it at call time.
    """

    def __init__(self, source: str) -> None:
        self.bare: set[str] = set()
        self.attributes: set[str] = set()
        self.imports: set[str] = set()
        self.from_imports: set[str] = set()
        bound: dict[str, set[str]] = {}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    self.bare.add(node.func.id)
                elif isinstance(node.func, ast.Attribute):
                    self.attributes.add(node.func.attr)
            elif isinstance(node, ast.Import):
                self.imports.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                self.from_imports.add(node.module)
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1
                  and isinstance(node.targets[0], ast.Name)):
                bound.setdefault(node.targets[0].id, set()).update(
                    _attributes_named(node.value))
        for name in self.bare & bound.keys():
            self.attributes |= bound[name]

    def calls(self, call: str) -> bool:
        """Whether the source calls ``call``: ``"name("`` bare or as an attribute,
        ``".name("`` as an attribute only."""
        name = call.strip(".(")
        return name in self.attributes or (not call.startswith(".") and name in self.bare)

    def imports_module(self, module: str, from_imports: bool = False) -> bool:
        """Whether the source imports ``module`` or one of its submodules with ``import``
        (or, with ``from_imports``, also names imported from them with ``from ... import``)."""
        names = self.imports | (self.from_imports if from_imports else set())
        return any(m == module or m.startswith(module + ".") for m in names)


def source_reach(module_name: str) -> SourceReach | None:
    """:class:`SourceReach` of ``module_name``'s source, or ``None`` when it does not import,
    has no source or does not parse."""
    source = _module_source(module_name)
    if source is None:
        return None
    try:
        return SourceReach(source)
    except SyntaxError:
        return None


def missing_call(module_name: str, calls: tuple[str, ...]) -> str | None:
    """Why ``module_name``'s source does not make every call of ``calls`` (as
    :meth:`SourceReach.calls` reads them), or ``None`` when it makes them all."""
    reach = source_reach(module_name)
    if reach is None:
        return f"the source of {module_name} cannot be read"
    for call in calls:
        if not reach.calls(call):
            return f"{module_name} never calls {call.lstrip('.')}...)"
    return None


def _trampoline(bridge: str, global_name: str, name: str) -> Callable[..., Any]:
    def trampoline(*args: Any, **kwargs: Any) -> Any:
        return getattr(sys.modules[bridge], global_name)(*args, **kwargs)

    trampoline.__name__ = name
    trampoline._moewire_trampoline = global_name  # type: ignore[attr-defined]
    return trampoline


def is_rebound(host_module: str, name: str, global_name: str) -> bool:
    """Whether ``host_module.<name>`` is now a trampoline to ``global_name`` (an undone
    rebind, or a module not imported, is not)."""
    module = sys.modules.get(host_module)
    bound = getattr(module, name, None) if module is not None else None
    return getattr(bound, "_moewire_trampoline", None) == global_name


def rebind_global(
    host_module: str, name: str, bridge: str, global_name: str, versions: str = ""
) -> None:
    """Make ``host_module.<name>`` call ``bridge.<global_name>``, which holds the original.

    Idempotent (a live trampoline is left as is); both writes go through the undo ledger.

    Args:
        host_module: the host module whose functions read ``name`` from their globals.
        name: the global to rebind (a staging function).
        bridge: the moewire module that holds the original as ``global_name``.
        global_name: the name of that global.
        versions: where the supported host versions are listed, for the refusal
            (``" (docs/vllm.md, version table)"``).

    Raises:
        RuntimeError: ``host_module`` has no callable ``name``.
    """
    module = importlib.import_module(host_module)
    if is_rebound(host_module, name, global_name):
        return
    current = getattr(module, name, None)
    if not callable(current):
        raise RuntimeError(
            f"{host_module}: no function {name!r} to interpose on; this build differs from "
            f"the versions moewire supports{versions}"
        )
    patches.patch_attr(sys.modules[bridge], global_name, current)
    patches.patch_attr(module, name, _trampoline(bridge, global_name, name))


def rank_path(scales_path: str, rank: int) -> str:
    """``scales_path`` with ``{rank}`` replaced by ``rank`` (each EP rank saves its own file)."""
    return scales_path.replace("{rank}", str(rank))


def begin_calibration(owner: Any, calibration: contextlib.AbstractContextManager) -> None:
    """Enter ``calibration`` (``moewire.megamoe.api.calibrating``) and keep it open on
    ``owner`` (a host's worker or scheduler) across the two calibration RPCs."""
    stack = contextlib.ExitStack()
    stack.enter_context(calibration)
    owner._moewire_calibration = stack


def finish_calibration(owner: Any, how: str) -> None:
    """Close the calibration :func:`begin_calibration` left open on ``owner`` (each amax is
    max-reduced and loaded on close).

    Args:
        owner: the host's worker or scheduler.
        how: how the user begins one, for the refusal (``"call moewire_begin_calibration
            first"``).

    Raises:
        RuntimeError: no calibration is in progress on ``owner``.
    """
    stack = getattr(owner, "_moewire_calibration", None)
    if stack is None:
        raise RuntimeError(f"moewire_finish_calibration: no calibration in progress; {how}")
    stack.close()
    owner._moewire_calibration = None


def register_host_classes(host: str) -> list[type]:
    """Register the Mega-MoE experts classes of ``host`` with moewire and return them.

    The function comes from the entry point ``host`` of the group :data:`HOST_CLASSES`, so a
    host package that needs another host's classes (ModelOpt's ``register`` wants vLLM's)
    reaches them the way the engines reach plugins, without importing that host package.

    Args:
        host: the entry point's name (``"vllm"``).

    Raises:
        RuntimeError: moewire's distribution declares no such entry point (moewire is on
            ``sys.path`` but not installed: ``pip install -e .`` in its checkout).
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=HOST_CLASSES) if ep.name == host]
    if not found:
        raise RuntimeError(
            f"moewire: no entry point {host!r} in the group {HOST_CLASSES!r}: moewire is "
            "imported from a source tree that is not installed; run `pip install -e .` in "
            "its checkout (pyproject.toml declares the group)"
        )
    return list(found[0].load()())
