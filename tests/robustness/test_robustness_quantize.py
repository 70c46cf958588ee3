"""quantize: recipes that match nothing, models already quantized, ModelOpt cfg dicts, saving
the quantized model, degenerate batches (issue 17). A refused call changes nothing."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from rb_helpers import FP8, NVFP4, RECIPE, Model, batch, calibrated, loop, outputs, snapshot, tried

import moewire
from moewire.megamoe.api import quantizers
from moewire.megamoe.convert import is_converted


def _refused(model, recipe, exc, match, **kwargs):
    before = snapshot(model)
    with pytest.raises(exc, match=match) as info:
        moewire.quantize(model, recipe, **kwargs)
    assert snapshot(model) == before
    tried()
    return str(info.value)


# -- issue 17, item 2: a recipe that matches no quantizer -----------------------------------


@pytest.mark.parametrize(
    "recipe",
    [
        [{"quantizer_name": "layers.*.experts.combine_quantizer", "cfg": FP8}],
        [{"quantizer_name": "*Combine_Quantizer", "cfg": FP8}],
        [{"quantizer_name": "experts.*", "cfg": FP8}],
    ],
    ids=["other-path", "wrong-case", "other-prefix"],
)
def test_recipe_matching_nothing_is_refused_and_names_the_quantizers(recipe):
    model = Model(n=1)
    nested = torch.nn.Module()
    nested.inner = model
    message = _refused(nested, recipe, ValueError, "matches any wire quantizer")
    assert "inner.layers.0.experts.dispatch_quantizer" in message
    assert "inner.layers.0.experts.combine_quantizer" in message
    assert not is_converted(model.layers[0].experts)


@pytest.mark.parametrize("recipe", [[], {"quant_cfg": []}], ids=["empty-list", "empty-quant-cfg"])
def test_empty_recipe_is_refused(recipe):
    model = Model(n=1)
    _refused(model, recipe, ValueError, "has no entries, so it would quantize nothing")
    assert not is_converted(model.layers[0].experts)


def test_matching_only_disabled_entries_is_accepted():
    model = moewire.quantize(Model(n=1), [{"quantizer_name": "*", "enable": False}])
    assert [q.mode for _, _, q in quantizers(model)] == ["disabled", "disabled"]


# -- issue 17, item 3: quantize on a model already quantized keeps the scales -----------------


def _amaxes(model):
    return {n: (float(q.amax), q.amax_source) for n, _, q in quantizers(model) if q.has_amax}


def test_quantize_again_keeps_the_calibrated_amax_and_outputs():
    model = calibrated()
    amaxes, want = _amaxes(model), outputs(model)
    assert len(amaxes) == 4
    moewire.quantize(model, RECIPE)
    assert _amaxes(model) == amaxes
    for got, ref in zip(outputs(model), want, strict=True):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    tried()


def test_quantize_after_load_scales_keeps_the_loaded_amax(tmp_path):
    path = moewire.save_scales(calibrated(), tmp_path / "s.json")
    model = moewire.quantize(Model(), RECIPE)
    moewire.load_scales(model, path)
    loaded = _amaxes(model)
    assert {s for _, s in loaded.values()} == {"loaded"}
    # the same formats under another recipe spelling: the dispatch turned off and back on
    moewire.quantize(model, {"quant_cfg": [*RECIPE["quant_cfg"],
                                           {"quantizer_name": "*", "enable": False},
                                           {"quantizer_name": "*", "enable": True}]})
    assert _amaxes(model) == loaded
    tried()


def test_quantize_with_another_format_is_refused_and_says_how_to_requantize():
    model = calibrated()
    recipe = [{"quantizer_name": "*dispatch_quantizer", "cfg": NVFP4},
              {"quantizer_name": "*combine_quantizer", "cfg": NVFP4}]
    message = _refused(model, recipe, ValueError,
                       r"layers.0.experts.dispatch_quantizer is already quantized as 'fp8' "
                       r"with a calibrated amax")
    assert "forward_loop=" in message and "keep_scales=False" in message


def test_requantize_on_purpose_with_keep_scales_false_or_a_forward_loop():
    recipe = [{"quantizer_name": "*dispatch_quantizer", "cfg": NVFP4},
              {"quantizer_name": "*combine_quantizer", "cfg": NVFP4}]
    model = moewire.quantize(calibrated(), recipe, keep_scales=False)
    assert _amaxes(model) == {}
    model = moewire.quantize(calibrated(), recipe, forward_loop=loop)
    fresh = moewire.quantize(Model(), recipe, forward_loop=loop)
    assert _amaxes(model) == _amaxes(fresh)
    tried(2)


def test_a_recipe_constant_amax_replaces_the_calibrated_one():
    model = moewire.quantize(calibrated(), [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {**FP8, "constant_amax": 448.0}},
        {"quantizer_name": "*combine_quantizer", "cfg": NVFP4}])
    assert {n: s for n, (_, s) in _amaxes(model).items()} == {
        "layers.0.experts.dispatch_quantizer": "constant",
        "layers.0.experts.combine_quantizer": "calibrated",
        "layers.1.experts.dispatch_quantizer": "constant",
        "layers.1.experts.combine_quantizer": "calibrated",
    }


@pytest.mark.modelopt
def test_quantize_after_mtq_quantize_keeps_modelopt_calibrated_amax(modelopt_registered):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    model = Model(n=1)
    mtq.quantize(model, {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                       *RECIPE["quant_cfg"]], "algorithm": "max"}, loop)
    amaxes = {n: float(q.static_amax) for n, _, q in quantizers(model)}
    moewire.quantize(model, RECIPE)
    assert {n: float(q.static_amax) for n, _, q in quantizers(model)} == amaxes
    tried()


# -- ModelOpt cfg dicts work unchanged -------------------------------------------------------


def test_modelopt_default_cfg_plus_an_entry_quantizes_the_combine():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    for base in (mtq.FP8_DEFAULT_CFG, mtq.NVFP4_DEFAULT_CFG):
        cfg = {**base, "quant_cfg": [*base["quant_cfg"],
                                     {"quantizer_name": "*combine_quantizer", "cfg": NVFP4}]}
        model = moewire.quantize(Model(n=1), cfg)
        modes = {n.rsplit(".", 1)[1]: (q.mode, q.fmt.name) for n, _, q in quantizers(model)}
        assert modes == {"dispatch_quantizer": ("disabled", "bf16"),
                         "combine_quantizer": ("quantize", "nvfp4")}
        tried()


def test_modelopt_entry_moewire_cannot_map_is_refused_when_it_matches():
    cfg = {"quant_cfg": [{"quantizer_name": "*quantizer",
                          "cfg": {"num_bits": (2, 1), "effective_bits": 4.5}}]}
    model = Model(n=1)
    _refused(model, cfg, ValueError, r"quant_cfg\[0\]: \*quantizer: matches the wire quantizer "
                                     r"layers.0.experts.dispatch_quantizer, and unknown cfg key")


def test_enable_only_entry_names_quantizer_and_entry_through_quantize():
    _refused(Model(n=1), [{"quantizer_name": "*", "enable": True}], ValueError,
             r"entries\[0\]: \*: enables the wire quantizer layers.0.experts.dispatch_quantizer")


# -- saving the whole quantized model ------------------------------------------------------------


def test_quantized_model_pickles_and_gives_the_same_outputs():
    model = calibrated()
    want = outputs(model)
    again = pickle.loads(pickle.dumps(model))
    assert type(again.layers[0].experts).__name__ == "QuantMegaMoEExperts"
    assert _amaxes(again) == _amaxes(model)
    for got, ref in zip(outputs(again), want, strict=True):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    tried()


def test_torch_save_of_the_quantizer_state_round_trips():
    model = calibrated()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = moewire.quantize(Model(), RECIPE)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert _amaxes(fresh) == {n: (a, "calibrated") for n, (a, _) in _amaxes(model).items()}


# -- degenerate batches ---------------------------------------------------------------------------


def test_per_call_amax_dispatch_with_no_token():
    model = moewire.quantize(Model(n=1), [{"quantizer_name": "*dispatch_quantizer", "cfg": FP8}])
    x, w, ids = batch(0, seed=1)
    (y,) = model(x, w, ids)
    assert y.shape == (0, x.shape[1])
    tried()


def test_per_call_amax_with_a_nan_token_names_the_input():
    model = moewire.quantize(Model(n=1), [{"quantizer_name": "*dispatch_quantizer", "cfg": FP8}])
    x, w, ids = batch(4, seed=2)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"layers.0.experts.dispatch_quantizer: the per-call "
                                         r"amax .* x holds NaN or inf"):
        model(x, w, ids)
    tried()
