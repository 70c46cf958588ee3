"""The undo ledger end to end: every patch moewire makes is recorded and undone, and what
another tool changed (before or after moewire) is left as that tool left it.

"Another tool" here swaps the class of DeepGEMM's module object (as moewire itself does)
or converts an experts module its own way; moewire must neither overwrite such a change
on undo nor undo a conversion that is not its own.
"""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
from mm_helpers import SHAPES, Model, batch

import moewire
from moewire import patches
from moewire.megamoe import convert as convert_module
from moewire.megamoe import hooks, layout_check
from moewire.megamoe.convert import convert, is_converted
from moewire.reference import MegaMoEExperts, deep_gemm

T = 20
RECIPE = {
    "quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp8"}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}},
    ]
}


class TheirModule(types.ModuleType):
    """Another tool's module class (a profiler, a lazy loader) swapped onto DeepGEMM."""


@pytest.fixture(autouse=True)
def clean_process():
    layout_check.reset_layout_checks()
    gc.collect()
    assert not convert_module._CONVERTED, "a converted module of an earlier test is alive"
    patches.undo_all()
    utils = deep_gemm.utils
    yield
    for module in (deep_gemm, utils):
        if type(module) is not types.ModuleType:
            module.__class__ = types.ModuleType
    layout_check.reset_layout_checks()


def _run(model: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=seed)
    return [y.view(torch.int16).clone() for y in model(x, w, ids)]


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _hooked_modules() -> list[types.ModuleType]:
    return [m for m in list(sys.modules.values()) if isinstance(m, hooks._HookedModule)]


def test_every_patch_is_on_the_ledger_and_every_entry_is_undone():
    """Break: hook a module's class, or replace a global, without the ledger (a plain
    ``__class__ =`` or ``setattr``): the hooked module is not on the ledger, and after
    unquantize it keeps moewire's class."""
    model = Model(n=1)
    moewire.quantize(model, RECIPE)
    hooked = _hooked_modules()
    assert deep_gemm in hooked and deep_gemm.utils in hooked
    for module in hooked:
        assert patches.is_patched(module), module.__name__
    entries = list(patches._LEDGER)
    assert entries and {e.name for e in entries} >= {None}
    moewire.unquantize(model)
    assert patches.active_patches() == [] and _hooked_modules() == []
    for entry in entries:
        obj = entry.target()
        if entry.name is None:
            assert type(obj) is entry.original
        elif entry.original is patches._MISSING:
            assert entry.name not in vars(obj)
        else:
            assert vars(obj)[entry.name] is entry.original


def test_a_class_another_tool_swapped_in_after_moewire_is_kept():
    """Break: undo a class swap without checking the object still has moewire's class:
    the other tool's class is overwritten by ModuleType."""
    model = Model(n=1)
    plain = _run(Model(n=1), seed=70)
    moewire.quantize(model, RECIPE)
    assert type(deep_gemm) is hooks._HookedModule
    deep_gemm.__class__ = TheirModule
    moewire.unquantize(model)
    assert type(deep_gemm) is TheirModule
    assert type(deep_gemm.utils) is types.ModuleType  # moewire's own swap is undone
    assert patches.active_patches() == []
    assert _same(_run(model, seed=70), plain)


def test_a_class_another_tool_swapped_in_before_moewire_is_kept():
    """The module is not a plain module, so moewire does not hook its class (the global
    proxy still reaches the kernel) and undo leaves the other tool's class."""
    deep_gemm.__class__ = TheirModule
    model = Model(n=1)
    plain = _run(Model(n=1), seed=71)
    moewire.quantize(model, RECIPE)
    assert type(deep_gemm) is TheirModule and not patches.is_patched(deep_gemm)
    assert not _same(_run(model, seed=71), plain)  # quantized all the same
    moewire.unquantize(model)
    assert type(deep_gemm) is TheirModule
    assert _same(_run(model, seed=71), plain)


def test_a_swap_between_two_moewire_patches_becomes_the_original():
    """moewire hooks, another tool swaps, moewire hooks again (a second quantize): undo
    brings back the other tool's class, not the plain module class moewire first saw.
    Break: keep the first original when the class changed in between."""
    holder = types.ModuleType("moewire_ledger_case")
    patches.patch_class(holder, hooks._HookedModule)
    holder.__class__ = TheirModule
    patches.patch_class(holder, hooks._HookedModule)
    assert patches.undo_all() == 1
    assert type(holder) is TheirModule


def test_unquantize_refuses_a_module_another_tool_converted_and_touches_nothing():
    """A module converted with another framework's quantizers (ModelOpt's path): moewire
    cannot undo that framework's class swap. Every check runs first, so the layer before
    it stays converted too. Break: drop the foreign check: unquantize strips the module."""
    model = Model(n=2)
    mine, theirs = model.layers[0].experts, model.layers[1].experts
    convert(mine, "layers.0.experts")
    convert(theirs, "layers.1.experts", attach=lambda m, attr, q: m.__dict__.update({attr: q}))
    ledger = patches.active_patches()
    with pytest.raises(TypeError, match=r"^layers\.1\.experts: ModelOpt converted this module "
                                        r"before moewire"):
        moewire.unquantize(model)
    assert is_converted(mine) and is_converted(theirs)
    assert hasattr(mine, "dispatch_quantizer") and hasattr(theirs, "combine_quantizer")
    assert patches.active_patches() == ledger
    # The test's own undo: the foreign mark is this test's, not another framework's.
    theirs.__dict__.pop(convert_module._FOREIGN)
    moewire.unquantize(model)
    assert type(mine) is MegaMoEExperts and type(theirs) is MegaMoEExperts
    assert patches.active_patches() == []
