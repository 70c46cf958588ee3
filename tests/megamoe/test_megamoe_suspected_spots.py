"""One test each for spots of the wrapper that no other test pinned down: the scale names
of a module quantized on its own, the scope of the ``DG_COMM_KERNEL_DEBUG`` refusal, and
the kernel proxy's cache after the wrapped attribute is replaced."""

from __future__ import annotations

import gc
import json
import types

import pytest
import torch
from mm_helpers import SHAPES, Model, batch, make_experts

import moewire
from moewire import patches
from moewire.megamoe import convert as convert_module
from moewire.megamoe import hooks, layout_check
from moewire.megamoe.api import quantizers

T = 20
HIDDEN = SHAPES["bf16xbf16"][0]


def _recipe(dispatch: str | None, combine: str | None) -> dict:
    entries = [{"quantizer_name": f"*{axis}_quantizer", "cfg": {"format": fmt}}
               for axis, fmt in (("dispatch", dispatch), ("combine", combine)) if fmt]
    return {"quant_cfg": entries}


@pytest.fixture(autouse=True)
def clean_process():
    layout_check.reset_layout_checks()
    gc.collect()
    assert not convert_module._CONVERTED, "a converted module of an earlier test is alive"
    patches.undo_all()
    yield
    layout_check.reset_layout_checks()


def test_a_module_quantized_on_its_own_has_unprefixed_scale_names(tmp_path):
    """Break: qualify with ``f"{module}.{attr}"`` whatever the module's name: the experts
    module quantized on its own names its scales ``.dispatch_quantizer``, and the file
    saved from it cannot be loaded into the same module in a model."""
    experts = make_experts(seed=3)
    moewire.quantize(experts, _recipe("fp8", None),
                     forward_loop=lambda m: m(*batch(T, HIDDEN, seed=90)))
    try:
        assert [name for name, _, _ in quantizers(experts)] == [
            "dispatch_quantizer", "combine_quantizer"]
        path = moewire.save_scales(experts, tmp_path / "scales.json")
        assert "dispatch_quantizer" in json.dumps(json.loads(path.read_text()))
        assert ".dispatch_quantizer" not in path.read_text()
    finally:
        moewire.unquantize(experts)
    model = Model(n=1)
    moewire.quantize(model, _recipe("fp8", None),
                     forward_loop=lambda m: m(*batch(T, HIDDEN, seed=90)))
    try:
        assert [name for name, _, _ in quantizers(model)] == [
            "layers.0.experts.dispatch_quantizer", "layers.0.experts.combine_quantizer"]
    finally:
        moewire.unquantize(model)


def test_debug_zeroing_refuses_the_combine_only(monkeypatch):
    """``DG_COMM_KERNEL_DEBUG=1`` zeroes the buffer after each call: the combine rows are
    gone, so a combine quantizer is refused; a dispatch-only recipe stages before the
    kernel and runs, bit for bit as without the variable. Break: refuse every quantized
    forward under the variable, or none."""
    x, w, ids = batch(T, HIDDEN, seed=91)
    outputs = {}
    for debug in ("0", "1"):
        monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", debug)
        model = Model(n=1)
        moewire.quantize(model, _recipe("fp8", None),
                         forward_loop=lambda m, x=x, w=w, ids=ids: m(x, w, ids))
        outputs[debug] = model(x, w, ids)[0].view(torch.int16).clone()
        moewire.unquantize(model)
    assert torch.equal(outputs["0"], outputs["1"])
    model = Model(n=1)
    moewire.quantize(model, _recipe(None, "mxfp8"))
    try:
        with pytest.raises(RuntimeError, match="DG_COMM_KERNEL_DEBUG=1 is set"):
            model(x, w, ids)
    finally:
        moewire.unquantize(model)


def test_the_kernel_proxy_wraps_a_replaced_kernel_again():
    """Break: reuse the cached wrapper by name alone: after the namespace's kernel is
    replaced, the proxy still calls the old function."""
    calls = []
    namespace = types.SimpleNamespace(fp8_fp4_mega_moe=lambda y, *a: calls.append("old"))
    proxy = hooks._KernelNamespace(namespace)
    first = proxy.fp8_fp4_mega_moe
    assert proxy.fp8_fp4_mega_moe is first  # cached while the kernel is the same
    namespace.fp8_fp4_mega_moe = lambda y, *a: calls.append("new")
    second = proxy.fp8_fp4_mega_moe
    assert second is not first and second.__wrapped__ is namespace.fp8_fp4_mega_moe
    second(torch.zeros(1))  # outside a quantized forward: passes through
    assert calls == ["new"]
