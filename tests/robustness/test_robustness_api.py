"""Random arguments to every public entry point: a ValueError/TypeError that names the
argument, or the reference result. Each hypothesis example counts as a case."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rb_helpers import RECIPE, Model, snapshot, tried

import moewire
from moewire import formats, recipes
from moewire.quantizer import WireQuantizer
from moewire.quantizer.config import CFG_KEYS, CfgError, parse_cfg

FAST = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10**6), st.text(max_size=8),
    st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
amaxes = st.one_of(
    junk, st.floats(0, 1e6), st.builds(lambda v: torch.tensor(v), st.floats(-10, 1e4)),
    st.builds(lambda n: torch.ones(n), st.integers(0, 3)),
    st.builds(lambda v: torch.tensor(v, dtype=torch.int32), st.integers(-3, 500)),
)
dtypes = st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64,
                          torch.int32, torch.bool])
names = st.one_of(st.sampled_from(formats.names()), junk)


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10
    return x.to(dtype)


def _names_the_argument(err: Exception, *words: str) -> None:
    text = str(err)
    assert any(w in text for w in words), f"{type(err).__name__} names none of {words}: {text}"


@FAST
@given(name=names, dtype=dtypes, amax=amaxes, seed=st.integers(0, 2**16),
       shape=st.lists(st.integers(0, 70), min_size=0, max_size=3))
def test_fake_quant_refuses_by_name_or_equals_the_reference(name, dtype, amax, seed, shape):
    tried()
    x = _tensor(shape, dtype, seed)
    try:
        out = moewire.fake_quant(x, name, amax)
    except (ValueError, TypeError) as err:
        _names_the_argument(err, "wire format", "amax", "x ", "x has", "x is", "last dim")
        return
    fmt = formats.get(name)
    amax_t = None if not fmt.needs_amax else torch.as_tensor(amax).float().reshape(())
    ref = fmt.reference(x, amax_t) if x.numel() else x.clone()
    if dtype == torch.float16:
        ref = torch.where(torch.isfinite(x), ref.clamp(-65504, 65504), ref)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)) if out.numel() else True


@FAST
@given(fmt=names, constant_amax=st.one_of(st.none(), amaxes), enable=junk,
       allow_dynamic=junk, name=st.one_of(st.none(), junk))
def test_wire_quantizer_constructor_names_the_argument(fmt, constant_amax, enable,
                                                       allow_dynamic, name):
    tried()
    try:
        q = WireQuantizer(fmt, constant_amax=constant_amax, enable=enable,
                          allow_dynamic=allow_dynamic, name=name)
    except (ValueError, TypeError) as err:
        _names_the_argument(err, "fmt", "wire format", "constant_amax", "enable",
                            "allow_dynamic", "name")
        return
    assert isinstance(enable, bool) and isinstance(allow_dynamic, bool)
    assert q.mode == ("quantize" if enable else "disabled")
    if constant_amax is not None:
        assert q.has_amax and q.amax_source == "constant"
        assert float(q.amax) == float(torch.tensor(float(constant_amax), dtype=torch.float32))


@FAST
@given(value=amaxes, fmt=st.sampled_from(["fp8", "nvfp4", "mxfp8"]))
def test_load_amax_refuses_by_name_and_changes_nothing(value, fmt):
    tried()
    q = WireQuantizer(fmt, name="layers.0.experts.combine_quantizer")
    before = (float(q.amax), q.has_amax, q.amax_source)
    try:
        q.load_amax(value)
    except (ValueError, TypeError) as err:
        _names_the_argument(err, "combine_quantizer")
        assert (float(q.amax), q.has_amax, q.amax_source) == before
        return
    v = float(torch.as_tensor(value).float().reshape(()))
    assert math.isfinite(v) and v >= 0 and float(q.amax) == v and q.amax_source == "loaded"


cfg_values = st.one_of(junk, st.just((4, 3)), st.just([2, 1]), st.just("e4m3"),
                       st.just({-1: 16, "type": "dynamic", "scale_bits": (4, 3)}),
                       st.just({-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
                       st.sampled_from(formats.names()))
cfgs = st.dictionaries(st.sampled_from([*CFG_KEYS, "effective_bits", "bias"]), cfg_values,
                       max_size=4)


@FAST
@given(cfg=st.one_of(cfgs, junk))
def test_parse_cfg_refuses_with_the_key_or_builds_a_quantizer(cfg):
    tried()
    try:
        spec = parse_cfg(cfg)
    except CfgError as err:
        if err.key:
            _names_the_argument(err, str(err.key[0]), repr(err.key[0]))
        return
    q = WireQuantizer(spec.fmt, constant_amax=spec.constant_amax, enable=spec.enable,
                      allow_dynamic=spec.allow_dynamic)
    assert q.fmt.name == spec.fmt


entries = st.lists(st.one_of(
    junk,
    st.fixed_dictionaries({"quantizer_name": st.one_of(
        st.sampled_from(["*", "*dispatch_quantizer", "*combine_quantizer", "layers.*",
                         "*Quantizer", "experts.*"]), junk)},
        optional={"cfg": st.one_of(cfgs, junk), "enable": junk,
                  "parent_class": st.just("nn.Linear")}),
), max_size=4)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=st.one_of(entries, st.builds(lambda e: {"quant_cfg": e}, entries), junk))
def test_quantize_refuses_by_name_and_changes_nothing_or_applies_the_recipe(recipe):
    tried()
    model = Model(n=1)
    before = snapshot(model)
    try:
        moewire.quantize(model, recipe)
    except (ValueError, TypeError) as err:
        _names_the_argument(err, "quantize", "recipe", "entries", "quant_cfg", "entry")
        assert snapshot(model) == before
        return
    rec = recipes.Recipe.from_entries(
        recipe["quant_cfg"] if isinstance(recipe, dict) else recipe, modelopt=True)
    for name, _, q in moewire.megamoe.api.quantizers(model):
        cfg = rec.match(name)
        want = "bf16" if cfg is None else parse_cfg(cfg).fmt
        assert q.fmt.name == want, name
        assert q.mode == ("disabled" if cfg is None or not cfg["enable"] else "quantize")


@pytest.mark.parametrize("forward_loop", [3, "loop"], ids=["int", "str"])
def test_quantize_refuses_a_forward_loop_that_is_not_callable(forward_loop):
    model = Model(n=1)
    with pytest.raises(TypeError, match="forward_loop must be callable"):
        moewire.quantize(model, RECIPE, forward_loop=forward_loop)
    with pytest.raises(TypeError, match="keep_scales must be True or False"):
        moewire.quantize(model, RECIPE, keep_scales="yes")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        moewire.quantize("model", RECIPE)
    tried(3)
