"""The undo ledger: every change moewire makes to an object it does not own, undoable.

moewire interposes on other packages' objects: the call-time globals of an experts
forward's module (:mod:`moewire.megamoe.hooks`), the class of DeepGEMM's module objects
(``_HookedModule``), vLLM's ``_import_deep_gemm`` and staging globals
(:mod:`moewire.integrations.vllm.bridge`), ``BaseModelLoader.load_model``
(:mod:`moewire.integrations.vllm`) and, for one forward at a time, transformers'
packed-sequence probe (:mod:`moewire.eval.masking`). Each such change goes through
:func:`patch_attr`, :func:`patch_class` or :func:`patched_attr` (for a block), which
record the original first; :func:`undo_all` puts every original back
(``moewire.unquantize`` calls it once no converted module remains).

The ledger holds the patched objects weakly where they allow it (modules, classes), so a
record never keeps an object alive nor outlives it; the originals are held strongly (they
must come back).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["active_patches", "is_patched", "patch_attr", "patch_class", "patched_attr",
           "undo_all"]

# The attribute was not in the object's own namespace (inherited, or absent): undo deletes it.
_MISSING = object()


@dataclass
class _Patch:
    target: Callable[[], Any]  # the patched object, weakly where it allows
    name: str | None  # the attribute; None for the object's class
    original: Any  # the value before moewire's first patch (or _MISSING)
    value: Any  # the value moewire set last


_LEDGER: list[_Patch] = []


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _own(obj: Any, name: str) -> Any:
    """``obj``'s own value of ``name`` (not an inherited one), or ``_MISSING``."""
    try:
        return vars(obj).get(name, _MISSING)
    except TypeError:  # no __dict__ (slots): what getattr gives is the object's own
        return getattr(obj, name, _MISSING)


def _entry(obj: Any, name: str | None) -> _Patch | None:
    for patch in _LEDGER:
        if patch.name == name and patch.target() is obj:
            return patch
    return None


def patch_attr(obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)``, recording the original the first time.

    Args:
        obj: a module, class or object moewire does not own.
        name: the attribute.
        value: the replacement.
    """
    patch = _entry(obj, name)
    current = _own(obj, name)
    if patch is not None and current is not patch.value:
        # Someone replaced moewire's value since: what is there now is the original.
        _LEDGER.remove(patch)
        patch = None
    if patch is None:
        _LEDGER.append(_Patch(_ref(obj), name, current, value))
    else:
        patch.value = value
    setattr(obj, name, value)


def patch_class(obj: Any, new_cls: type) -> None:
    """``obj.__class__ = new_cls``, recording the original class the first time."""
    patch = _entry(obj, None)
    if patch is not None and type(obj) is not patch.value:
        _LEDGER.remove(patch)
        patch = None
    if patch is None:
        _LEDGER.append(_Patch(_ref(obj), None, type(obj), new_cls))
    else:
        patch.value = new_cls
    obj.__class__ = new_cls


def is_patched(obj: Any, name: str | None = None) -> bool:
    """Whether moewire's patch of ``obj``'s ``name`` (``None``: its class) is recorded."""
    return _entry(obj, name) is not None


def active_patches() -> list[tuple[Any, str | None]]:
    """Every recorded patch still in effect, oldest first: ``(object, attribute or None
    for its class)``."""
    return [
        (patch.target(), patch.name) for patch in _LEDGER if patch.target() is not None
    ]


def _restore(patch: _Patch) -> bool:
    """Put ``patch``'s original back unless someone replaced moewire's value since."""
    obj = patch.target()
    if obj is None:
        return False
    if patch.name is None:
        if type(obj) is not patch.value:
            return False
        obj.__class__ = patch.original
        return True
    if _own(obj, patch.name) is not patch.value:
        return False
    if patch.original is _MISSING:
        delattr(obj, patch.name)
    else:
        setattr(obj, patch.name, patch.original)
    return True


@contextmanager
def patched_attr(obj: Any, name: str, value: Any) -> Iterator[None]:
    """:func:`patch_attr` for the block only: what was there comes back on exit, error or
    not. Inside a block that already set the same value, it changes nothing (the outer
    block restores); over an earlier :func:`patch_attr` of moewire's, that patch's value
    comes back and its record (with the true original) stays."""
    outer = _entry(obj, name)
    if outer is not None and _own(obj, name) is value:
        yield
        return
    before = outer.value if outer is not None else None
    patch_attr(obj, name, value)
    try:
        yield
    finally:
        patch = _entry(obj, name)
        if patch is not None and patch is outer:
            if _own(obj, name) is value:
                setattr(obj, name, before)
            patch.value = before
        elif patch is not None:
            _LEDGER.remove(patch)
            _restore(patch)


def undo_all() -> int:
    """Put back every original, newest patch first, and empty the ledger.

    A value that someone else replaced after moewire (a test's monkeypatch, another
    library) is left alone: restoring moewire's original would undo their change.

    Returns:
        The number of patches undone.
    """
    undone = 0
    while _LEDGER:
        undone += _restore(_LEDGER.pop())
    return undone
