"""``moewire.unquantize``: a quantized model comes back bit for bit, and so does the process.

Every test starts with no converted module alive and nothing patched, so that
unquantizing the last one undoes every patch (``moewire.patches``).
"""

from __future__ import annotations

import gc
import io
import types

import pytest
import torch
from mm_helpers import SHAPES, Model, batch

import moewire
from moewire import patches
from moewire.megamoe import convert as convert_module
from moewire.megamoe import layout_check
from moewire.megamoe.convert import is_converted
from moewire.reference import MegaMoEExperts, deep_gemm
from moewire.reference import experts as experts_module

T = 20
HIDDEN = SHAPES["bf16xbf16"][0]
RECIPE = {
    "quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp8"}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}},
    ]
}


@pytest.fixture(autouse=True)
def nothing_converted():
    layout_check.reset_layout_checks()
    gc.collect()
    assert not convert_module._CONVERTED, "a converted module of an earlier test is alive"
    # Earlier tests dropped their quantized models without unquantize: start unpatched.
    patches.undo_all()
    yield
    layout_check.reset_layout_checks()


def _bits(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [y.view(torch.int16).clone() for y in outputs]


def _run(model: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    x, w, ids = batch(T, HIDDEN, seed=seed)
    return _bits(model(x, w, ids))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_quantize_then_unquantize_runs_bit_identical_twice_in_a_row():
    """Break: leave the staging proxy in place, or keep the class: the first round's
    patches stay (the ledger is not empty) and the module is not its original class;
    skip deleting the quantizers: the state dict has extra keys."""
    stage, kernels = experts_module.stage_mega_moe_inputs, experts_module.deep_gemm
    untouched = Model(n=2)
    model = Model(n=2)  # the same seeds
    keys = set(untouched.state_dict())
    for round_ in range(2):
        plain = _run(untouched, seed=40 + round_)
        moewire.quantize(model, RECIPE)
        assert patches.active_patches()
        assert not _same(_run(model, seed=40 + round_), plain)  # it was quantized
        assert moewire.unquantize(model) is model
        assert _same(_run(model, seed=40 + round_), plain)
        for layer in model.layers:
            assert type(layer.experts) is MegaMoEExperts
            assert not hasattr(layer.experts, "dispatch_quantizer")
            assert not any(k.startswith("_moewire") for k in vars(layer.experts))
        assert set(model.state_dict()) == keys
        assert patches.active_patches() == []
        assert experts_module.stage_mega_moe_inputs is stage
        assert experts_module.deep_gemm is kernels
        assert type(deep_gemm) is types.ModuleType


def test_patches_stay_while_another_converted_model_lives():
    """Break: undo the patches on every unquantize: the other model's forward finds no
    hook and fails closed."""
    first, second = Model(n=1), Model(n=1)
    moewire.quantize(first, RECIPE)
    moewire.quantize(second, RECIPE)
    moewire.unquantize(first)
    assert patches.active_patches()
    quantized = _run(second, seed=50)  # still reaches both hooks
    moewire.unquantize(second)
    assert patches.active_patches() == []
    assert not _same(_run(second, seed=50), quantized)


def test_a_dropped_converted_model_does_not_hold_the_patches():
    """Break: hold converted modules strongly: the dropped model keeps the patches."""
    dropped, kept = Model(n=1), Model(n=1)
    moewire.quantize(dropped, RECIPE)
    moewire.quantize(kept, RECIPE)
    del dropped
    gc.collect()
    moewire.unquantize(kept)
    assert patches.active_patches() == []


def test_a_loaded_model_keeps_its_hooks_while_another_model_is_unquantized():
    """A quantized model saved with torch.save and loaded back is as live as one converted
    here: unquantizing another model leaves the hooks the loaded one needs, and it runs
    quantized. Break: leave the loaded module out of the live set (convert._rebuild_quant):
    unquantizing the other model, the last one known, undoes every patch and the loaded
    model's forward fails closed."""
    saved = Model(n=1)
    moewire.quantize(saved, RECIPE)
    quantized = _run(saved, seed=70)
    data = io.BytesIO()
    torch.save(saved, data)
    moewire.unquantize(saved)
    assert patches.active_patches() == []  # what the loaded model needs, it installs itself
    loaded = torch.load(io.BytesIO(data.getvalue()), weights_only=False)
    other = Model(n=1)
    moewire.quantize(other, RECIPE)
    moewire.unquantize(other)
    assert patches.active_patches()
    assert _same(_run(loaded, seed=70), quantized)
    moewire.unquantize(loaded)
    assert patches.active_patches() == []


@pytest.mark.parametrize(
    "target",
    [lambda: Model(n=1), lambda: torch.nn.Linear(2, 2)],
    ids=["experts-never-quantized", "no-experts-at-all"],
)
def test_unquantize_of_a_model_with_nothing_converted_is_an_error(target):
    with pytest.raises(ValueError, match="nothing to undo; pass the model moewire.quantize"):
        moewire.unquantize(target())


def test_unquantize_refuses_a_non_module():
    with pytest.raises(TypeError, match="unquantize: model must be an nn.Module"):
        moewire.unquantize([Model(n=1)])


def test_a_quantized_model_quantizes_again_after_unquantize():
    """Break: make installing the hooks idempotent on a record kept apart from the live
    globals (a set of installed adapters): after the undo nothing installs them again and
    the second round's forward fails closed."""
    model = Model(n=1)
    moewire.quantize(model, RECIPE)
    once = _run(model, seed=60)
    moewire.unquantize(model)
    moewire.quantize(model, RECIPE)
    assert is_converted(model.layers[0].experts)
    assert _same(_run(model, seed=60), once)
    moewire.unquantize(model)
