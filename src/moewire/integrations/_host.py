"""Host-neutral glue that every serving-engine integration needs (vLLM, SGLang).

- :func:`rebind_global`: make a host module's global (a staging function its forward
  reads at call time) a trampoline to a global of a moewire bridge module, so that one
  experts adapter names the bridge for both the staging function and the DeepGEMM
  namespace; through the undo ledger (:mod:`moewire.patches`).
- :func:`module_source` and :func:`calls`: recognise a host module by the calls its source
  makes, never by a version.
- :func:`rank_path`: a scales path with ``{rank}`` replaced.

May import: the standard library and ``moewire.patches``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

from moewire import patches

__all__ = ["calls", "module_source", "rank_path", "rebind_global"]


def module_source(module_name: str) -> str | None:
    """The source of ``module_name``, or ``None`` when it does not import or has none."""
    try:
        return inspect.getsource(importlib.import_module(module_name))
    except (ImportError, OSError, TypeError):
        return None


def calls(source: str, call: str) -> bool:
    """Whether ``source`` makes the call ``call`` (``"fp8_mega_moe("``), not only defines it."""
    return re.search(rf"(?<!def ){re.escape(call)}", source) is not None


def _trampoline(bridge: str, global_name: str, name: str) -> Callable[..., Any]:
    def trampoline(*args: Any, **kwargs: Any) -> Any:
        return getattr(sys.modules[bridge], global_name)(*args, **kwargs)

    trampoline.__name__ = name
    trampoline._moewire_trampoline = global_name  # type: ignore[attr-defined]
    return trampoline


def rebind_global(host_module: str, name: str, bridge: str, global_name: str) -> None:
    """Make ``host_module.<name>`` call ``bridge.<global_name>``, which holds the original.

    Idempotent (a live trampoline is left as is); both writes go through the undo ledger.

    Raises:
        RuntimeError: ``host_module`` has no callable ``name``.
    """
    module = importlib.import_module(host_module)
    current = getattr(module, name, None)
    if getattr(current, "_moewire_trampoline", None) == global_name:
        return
    if not callable(current):
        raise RuntimeError(
            f"{host_module}: no function {name!r} to interpose on; this build differs from "
            "the versions moewire supports"
        )
    patches.patch_attr(sys.modules[bridge], global_name, current)
    patches.patch_attr(module, name, _trampoline(bridge, global_name, name))


def rank_path(scales_path: str, rank: int) -> str:
    """``scales_path`` with ``{rank}`` replaced by ``rank`` (each EP rank saves its own file)."""
    return scales_path.replace("{rank}", str(rank))
