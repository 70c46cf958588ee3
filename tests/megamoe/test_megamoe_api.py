"""moewire.quantize / calibrate / save_scales / load_scales / summary on the stand-in."""

from __future__ import annotations

import contextlib
import json

import mm_oracles as oracles
import numpy as np
import pytest
import torch
from mm_helpers import SHAPES, Model, batch, region
from torch import nn

import moewire
from moewire.megamoe import layout_check
from moewire.megamoe.api import calibrating, quantizers
from moewire.reference import forward_context

T = 16
HIDDEN = SHAPES["bf16xbf16"][0]
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
RECIPE = {
    "quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"num_bits": (4, 3)}},
        {"quantizer_name": "*combine_quantizer", "cfg": NVFP4},
        {"quantizer_name": "layers.1.experts.dispatch_quantizer", "cfg": {"enable": False}},
    ]
}


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def padded_batch(seed, t=T):
    """A batch whose padding tokens and slot-less tokens carry large values."""
    x, w, ids = batch(t, HIDDEN, seed=seed)
    pad = torch.zeros(t, dtype=torch.bool)
    pad[:2] = True
    ids[2] = -1  # a real token routed to nothing
    x[:3] = 77.0
    return x, w, ids, pad


def test_quantize_configures_by_qualified_name_and_calibrates_valid_rows_only():
    model = Model(n=2)
    reference = Model(n=2)  # the same seeds: the unquantized outputs
    buf = model.layers[0].experts.get_symm_buffer()
    seen = {"combine": [0.0, 0.0], "dispatch": [0.0, 0.0]}
    outputs = []

    def loop(m):
        for step in range(2):
            x, w, ids, pad = padded_batch(seed=20 + step)
            region(buf).fill_(3e4)
            with forward_context(is_padding=pad):
                for i, layer in enumerate(m.layers):
                    y = layer(x, w, ids)
                    outputs.append(y.clone())
                    topk = buf.topk_idx[:T].numpy()
                    rows = oracles.to_np(region(buf))
                    for s in range(topk.shape[1]):
                        valid = topk[:, s] >= 0
                        if valid.any():
                            peak = float(np.abs(rows[s, :T][valid]).max())
                            seen["combine"][i] = max(seen["combine"][i], peak)
                    routed = (topk >= 0).any(axis=1)
                    peak = float(np.abs(oracles.to_np(x)[routed]).max())
                    seen["dispatch"][i] = max(seen["dispatch"][i], peak)

    moewire.quantize(model, RECIPE, forward_loop=loop)
    names = [n for n, _, _ in quantizers(model)]
    assert names == [
        "layers.0.experts.dispatch_quantizer",
        "layers.0.experts.combine_quantizer",
        "layers.1.experts.dispatch_quantizer",
        "layers.1.experts.combine_quantizer",
    ]
    e0, e1 = model.layers[0].experts, model.layers[1].experts
    assert e0.dispatch_quantizer.fmt.name == "fp8" and e0.combine_quantizer.fmt.name == "nvfp4"
    assert e1.dispatch_quantizer.mode == "disabled"
    for i, e in enumerate((e0, e1)):
        assert float(e.combine_quantizer.static_amax) == seen["combine"][i]
    assert float(e0.dispatch_quantizer.static_amax) == seen["dispatch"][0]
    assert seen["dispatch"][0] < 77.0 and max(seen["combine"]) < 3e4
    # Values passed through unquantized while calibrating.
    step = 0
    x, w, ids, pad = padded_batch(seed=20 + step)
    with forward_context(is_padding=pad):
        want = [layer(x, w, ids) for layer in reference.layers]
    for a, b in zip(outputs[:2], want, strict=True):
        np.testing.assert_array_equal(oracles.torch_bits(a), oracles.torch_bits(b))
    assert e0.combine_quantizer.mode == "quantize"


def test_quantize_then_run_uses_the_calibrated_scales():
    model = Model(n=1)

    def loop(m):
        x, w, ids, pad = padded_batch(seed=30)
        with forward_context(is_padding=pad):
            m(x, w, ids)

    moewire.quantize(model, RECIPE, forward_loop=loop)
    experts = model.layers[0].experts
    amax = float(experts.combine_quantizer.static_amax)
    x, w, ids = batch(T, HIDDEN, seed=31)
    y = experts(x, w, ids)
    buf = experts.get_symm_buffer()
    rows, topk = oracles.to_np(region(buf)), buf.topk_idx[:T].numpy()
    want = oracles.resum(rows, topk, T, quant=lambda r: oracles.nvfp4(r[None], amax)[0])
    np.testing.assert_array_equal(oracles.torch_bits(y), want)


def calibrated_model():
    model = Model(n=2)

    def loop(m):
        x, w, ids, pad = padded_batch(seed=40)
        with forward_context(is_padding=pad):
            m(x, w, ids)

    return moewire.quantize(model, RECIPE, forward_loop=loop)


def test_calibrating_context_may_span_calls_as_calibrate_does():
    """The two-RPC shape: enter in one call, run the engine, close in another."""
    want = calibrated_model()
    model = moewire.quantize(Model(n=2), RECIPE)
    stack = contextlib.ExitStack()
    stack.enter_context(calibrating(model))
    assert model.layers[0].experts.combine_quantizer.mode == "calibrate"
    x, w, ids, pad = padded_batch(seed=40)
    with forward_context(is_padding=pad):
        model(x, w, ids)
    stack.close()
    amaxes = [[None if q.static_amax is None else float(q.static_amax)
               for _, _, q in quantizers(m)] for m in (model, want)]
    assert amaxes[0] == amaxes[1] and amaxes[0][1] is not None
    assert moewire.summary(model) == moewire.summary(want)


@pytest.mark.parametrize("suffix", [".safetensors", ".json"], ids=["safetensors", "json"])
def test_save_load_round_trip(tmp_path, suffix):
    model = calibrated_model()
    path = moewire.save_scales(model, tmp_path / f"scales{suffix}")
    fresh = moewire.quantize(Model(n=2), RECIPE)
    loaded = moewire.load_scales(fresh, path)
    assert loaded == [
        "layers.0.experts.dispatch_quantizer",
        "layers.0.experts.combine_quantizer",
        "layers.1.experts.combine_quantizer",
    ]
    for (n, _, a), (m, _, b) in zip(quantizers(model), quantizers(fresh), strict=True):
        assert n == m and a.mode == b.mode
        if a.static_amax is None:
            assert b.static_amax is None
        else:
            assert torch.equal(a.static_amax.cpu(), b.static_amax.cpu())
    assert "(calibrated)" in moewire.summary(model)
    assert moewire.summary(model).replace("(calibrated)", "(loaded)") == moewire.summary(fresh)


def _drop_layer(model):
    return moewire.quantize(Model(n=1), RECIPE)


def _extra_layer(model):
    return moewire.quantize(Model(n=3), RECIPE)


def _other_format(model):
    other = {
        "quant_cfg": RECIPE["quant_cfg"]
        + [{"quantizer_name": "*combine_quantizer", "cfg": {"num_bits": (4, 3)}}]
    }
    return moewire.quantize(Model(n=2), other)


def _constant_amax(model):
    fixed = {
        "quant_cfg": RECIPE["quant_cfg"]
        + [
            {
                "quantizer_name": "layers.1.*combine_quantizer",
                "cfg": {**NVFP4, "constant_amax": 2688.0},
            }
        ]
    }
    return moewire.quantize(Model(n=2), fixed)


@pytest.mark.parametrize(
    "target,match",
    [
        (_constant_amax, r"layers\.1\.experts\.combine_quantizer has constant_amax=2688"),
        (_drop_layer, "the model has no such module"),
        (_extra_layer, r"quantizers \['layers\.2\.experts\.combine_quantizer'.* not in"),
        (_other_format, "saved with format 'nvfp4' but is 'fp8'"),
    ],
    ids=["constant-amax-mismatch", "missing-module", "module-not-in-file", "format-mismatch"],
)
@pytest.mark.parametrize("suffix", [".safetensors", ".json"], ids=["safetensors", "json"])
def test_load_refusals(tmp_path, target, match, suffix):
    path = moewire.save_scales(calibrated_model(), tmp_path / f"s{suffix}")
    model = target(None)
    before = moewire.summary(model)
    with pytest.raises(ValueError, match=match):
        moewire.load_scales(model, path)
    assert moewire.summary(model) == before  # nothing half-loaded


def test_load_refuses_a_shape_mismatch_and_foreign_files(tmp_path):
    path = moewire.save_scales(calibrated_model(), tmp_path / "s.json")
    data = json.loads(path.read_text())
    entry = data["quantizers"]["layers.0.experts.combine_quantizer"]
    entry["amax"], entry["shape"] = [1.0, 2.0], [2]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"amax of shape \[2\]"):
        moewire.load_scales(moewire.quantize(Model(n=2), RECIPE), path)
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not written by moewire.save_scales"):
        moewire.load_scales(moewire.quantize(Model(n=2), RECIPE), foreign)


def test_summary_has_one_line_per_quantizer():
    text = moewire.summary(calibrated_model())
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("layers.0.experts.dispatch_quantizer: format=fp8 mode=quantize")
    assert "layers.1.experts.dispatch_quantizer: format=" in lines[2]
    assert "mode=disabled" in lines[2]
    assert "scale=static" in lines[1]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: moewire.quantize(nn.Linear(2, 2), RECIPE), "contains no Mega-MoE experts"),
        (lambda: moewire.save_scales(nn.Linear(2, 2), "x.json"), "no quantized Mega-MoE"),
    ],
    ids=["quantize-no-experts", "save-no-experts"],
)
def test_api_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "recipe",
    ["moe_fp8_dispatch_nvfp4_combine", RECIPE["quant_cfg"][:2]],
    ids=["packaged-name", "list-of-entries"],
)
def test_quantize_accepts_names_and_lists(recipe):
    model = moewire.quantize(Model(n=1), recipe)
    experts = model.layers[0].experts
    assert experts.dispatch_quantizer.fmt.name == "fp8"
    assert experts.combine_quantizer.fmt.name == "nvfp4"
    assert experts.combine_quantizer.mode == "quantize"


@pytest.mark.parametrize(
    "recipe,exc,match",
    [
        ({"algorithm": "max"}, ValueError, "list form"),
        (42, TypeError, "recipe must be a recipe name"),
    ],
    ids=["dict-without-quant-cfg", "wrong-type"],
)
def test_recipe_refusals(recipe, exc, match):
    with pytest.raises(exc, match=match):
        moewire.quantize(Model(n=1), recipe)
