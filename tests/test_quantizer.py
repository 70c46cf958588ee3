"""WireQuantizer: modes, calibration against a float64 oracle, refusals, cfg mapping, state."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from moewire import formats
from moewire.quantizer import WireQuantizer, WireQuantizerLike
from moewire.quantizer.config import CFG_KEYS, CfgError, QuantizerSpec, modelopt_table, parse_cfg

NVFP4_BLOCKS = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
MX_BLOCKS = {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(shape, seed, dtype=torch.bfloat16, scale=3.0) -> torch.Tensor:
    # Heavy-ish tails so the max is not near a trivial value.
    x = torch.randn(shape, generator=_gen(seed)) * scale
    x = x * torch.exp(torch.randn(shape, generator=_gen(seed + 1000)))
    return x.to(dtype)


def _oracle_max(batches) -> float:
    """float64 max of |x| over the valid, non-NaN elements of every batch (NumPy)."""
    best = 0.0
    for x, valid in batches:
        a = np.abs(x.double().numpy())
        keep = ~np.isnan(a)
        if valid is not None:
            keep &= np.broadcast_to(valid.numpy(), a.shape)
        if keep.any():
            best = max(best, float(a[keep].max()))
    return best


# -- modes ------------------------------------------------------------------------------


def test_default_is_quantize_and_enable_switches_modes():
    q = WireQuantizer("fp8")
    assert (q.mode, q.enabled) == ("quantize", True)
    q.disable()
    assert (q.mode, q.enabled) == ("disabled", False)
    q.enable()
    assert q.mode == "quantize"
    q.enabled = False
    assert q.mode == "disabled"
    assert WireQuantizer("fp8", enable=False).mode == "disabled"


def test_mode_setter_refuses_unknown_mode():
    q = WireQuantizer("fp8")
    with pytest.raises(ValueError, match="mode 'train' is not one of"):
        q.mode = "train"


def contract_members() -> list[str]:
    return [n for n in vars(WireQuantizerLike) if not n.startswith("_") or n == "__call__"]


def test_wire_quantizer_implements_the_contract():
    q = WireQuantizer("nvfp4")
    assert len(contract_members()) == 14
    assert [n for n in contract_members() if not hasattr(q, n)] == []


def test_disabled_passes_values_through():
    q = WireQuantizer("nvfp4", enable=False)
    x = _data((4, 32), 1)
    assert q(x) is x


def test_calibrating_passes_through_collects_and_loads():
    q = WireQuantizer("nvfp4")
    batches = [_data((3, 32), s) for s in (2, 3, 4)]
    with q.calibrating():
        assert q.mode == "calibrate"
        for x in batches:
            assert q(x) is x
    assert q.mode == "quantize"
    assert q.has_amax and q.amax_source == "calibrated"
    assert float(q.amax) == _oracle_max([(x, None) for x in batches])


def test_calibrating_leaves_disabled_quantizer_alone():
    q = WireQuantizer("fp8", enable=False)
    with q.calibrating():
        assert q.mode == "disabled"
        q(_data((2, 16), 5))
    assert not bool(q.calib_seen) and not q.has_amax


def test_calibrating_does_not_nest():
    q = WireQuantizer("fp8")
    with pytest.warns(RuntimeWarning, match="saw no data"), q.calibrating():
        with pytest.raises(RuntimeError, match="does not nest"), q.calibrating():
            pass


def test_calibrating_body_error_restores_mode_and_loads_nothing():
    q = WireQuantizer("fp8")
    with pytest.raises(KeyError), q.calibrating():
        q(_data((2, 16), 6))
        raise KeyError("boom")
    assert q.mode == "quantize" and not q.has_amax


def test_calibrating_keeps_constant_amax():
    q = WireQuantizer("nvfp4", constant_amax=2688.0)
    x = _data((2, 32), 7)
    with q.calibrating():
        assert q(x) is x
    assert float(q.amax) == 2688.0 and q.amax_source == "constant"


def test_calibrating_block_format_loads_no_amax():
    q = WireQuantizer("mxfp8")
    with q.calibrating():
        q(_data((2, 32), 8))
    assert not q.has_amax and q.is_static_scale()


def test_calibrating_resets_previous_collection():
    q = WireQuantizer("fp8")
    q.collect(torch.full((2, 4), 1000.0))
    x = _data((2, 16), 9)
    with q.calibrating():
        q(x)
    assert float(q.amax) == _oracle_max([(x, None)])


# -- quantize ---------------------------------------------------------------------------

_FIXED = [("fp8", 3.5), ("nvfp4", 2688.0), ("fp8_b128", None), ("fp8_b128_ue8m0", None),
          ("fp8_b32_ue8m0", None), ("mxfp8", None), ("mxfp4", None), ("nvfp4_token", None),
          ("logfmt10", None), ("bf16", None)]


@pytest.mark.parametrize(("name", "amax"), _FIXED, ids=[n for n, _ in _FIXED])
def test_quantize_equals_the_format(name, amax):
    x = _data((4, 256), 10)
    q = WireQuantizer(name, constant_amax=amax)
    expected = formats.get(name).qdq(x, amax)
    assert torch.equal(q(x).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_dynamic_amax_is_the_max_of_the_call(name):
    x = _data((4, 64), 11)
    q = WireQuantizer(name)
    assert not q.is_static_scale() and q.static_amax is None
    expected = formats.get(name).qdq(x, x.abs().amax().float())
    assert torch.equal(q(x).view(torch.int16), expected.view(torch.int16))


def test_dynamic_amax_refused_when_not_allowed():
    q = WireQuantizer("fp8", allow_dynamic=False)
    with pytest.raises(RuntimeError, match="needs an amax.*constant_amax"):
        q(_data((2, 16), 12))


@pytest.mark.parametrize(
    ("name", "amax"),
    [("fp8", 448.0 * 2.0**-3), ("fp8", 448.0 * 4.0), ("nvfp4", 2688.0),
     ("nvfp4", 2688.0 * 2.0**-5)],
    ids=["fp8-small", "fp8-large", "nvfp4-unit-gs", "nvfp4-pow2-gs"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fixed_scale_is_idempotent(name, amax, dtype):
    # Power-of-two scales make every dequantized value exact in the input dtype. Compared
    # by value: NVFP4's sign(x) * q * bs (ModelOpt's formula) maps -0.0 to +0.0.
    q = WireQuantizer(name, constant_amax=amax)
    x = _data((8, 64), 13, dtype=dtype, scale=amax / 40)
    once = q(x)
    assert not torch.equal(once, x)
    assert torch.equal(q(once), once)


def test_static_scale_and_what_a_kernel_reads():
    """A fused kernel reads mode, fmt and static_amax (moewire.megamoe.resum)."""
    fp8 = WireQuantizer("fp8")
    assert not fp8.is_static_scale() and fp8.static_amax is None
    fp8.load_amax(2.0)
    assert fp8.fmt.name == "fp8" and fp8.static_amax is fp8.amax
    assert fp8.is_static_scale()
    mx = WireQuantizer("mxfp4")
    assert mx.is_static_scale() and mx.static_amax is None and mx.fmt.name == "mxfp4"
    mx.disable()
    assert mx.mode == "disabled"
    assert mx.scale_amax(torch.ones(32)) is None


# -- calibration ------------------------------------------------------------------------


def test_collect_equals_float64_max_over_valid_rows():
    q = WireQuantizer("nvfp4")
    batches = []
    for seed in range(4):
        x = _data((3, 5, 32), 20 + seed)
        valid = torch.rand((3, 5, 1), generator=_gen(40 + seed)) < 0.6
        x[~valid.expand_as(x)] = 1e30  # masked rows are huge: they must not count
        batches.append((x.float(), valid))
        q.collect(x.float(), valid)
    assert float(q.calib_amax) == _oracle_max(batches)
    assert bool(q.calib_seen)


def test_collect_skips_nan_counts_it_and_keeps_finite_max():
    q = WireQuantizer("fp8")
    x = _data((6, 32), 21)
    x[2] = float("nan")
    x[4, 3] = float("nan")
    q.collect(x)
    assert float(q.calib_amax) == _oracle_max([(x, None)])
    assert math.isfinite(float(q.calib_amax))
    assert int(q.calib_nan) == 33
    with pytest.warns(RuntimeWarning, match="skipped 33 NaN values"):
        q.load_calib_amax()
    assert float(q.amax) == _oracle_max([(x, None)])


def test_collect_all_false_mask_is_no_data():
    q = WireQuantizer("fp8")
    q.collect(_data((4, 16), 22), torch.zeros((4, 1), dtype=torch.bool))
    assert not bool(q.calib_seen) and float(q.calib_amax) == 0.0


def _raise(*args, **kwargs):
    raise AssertionError("host sync inside a capturable path")


def test_collect_and_calibrate_forward_never_sync(monkeypatch):
    q = WireQuantizer("nvfp4")
    x = _data((4, 32), 23)
    valid = torch.tensor([[True], [False], [True], [True]])
    for attr in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, _raise)
    q.collect(x, valid)
    q.mode = "calibrate"
    q(x)
    q.mode = "quantize"
    dynamic = q.scale_amax(x)
    static = (q.is_static_scale(), q.static_amax)
    monkeypatch.undo()
    assert static == (False, None)
    assert float(dynamic) == float(x.abs().amax())
    assert float(q.calib_amax) == _oracle_max([(x, None)])


def test_no_data_warns_and_keeps_no_amax():
    q = WireQuantizer("nvfp4")
    with pytest.warns(RuntimeWarning, match="saw no data.*sync_amax.*constant_amax"):
        with q.calibrating():
            pass
    assert not q.has_amax and q.static_amax is None


def _zeros(q):
    q.collect(torch.zeros(4, 16))


def _infs(q):
    x = _data((4, 16), 24).float()
    x[1, 2] = float("inf")
    q.collect(x)


def _only_nan(q):
    q.collect(torch.full((2, 16), float("nan")))


def _corrupt_nan(q):
    q.collect(_data((2, 16), 25))
    q.calib_amax.fill_(float("nan"))


@pytest.mark.parametrize(
    ("fill", "error", "match"),
    [
        (_zeros, ValueError, "every collected value was 0"),
        (_infs, ValueError, "held inf"),
        (_only_nan, ValueError, r"0 or NaN \(32 NaN values were skipped\)"),
        (_corrupt_nan, ValueError, "max is NaN"),
    ],
    ids=["zero", "inf", "only-nan", "nan-state"],
)
def test_load_calib_amax_refuses(fill, error, match):
    q = WireQuantizer("fp8")
    fill(q)
    with pytest.raises(error, match=match):
        q.load_calib_amax()
    assert not q.has_amax and float(q.amax) == 0.0


def test_load_calib_amax_refuses_constant_quantizer():
    q = WireQuantizer("fp8", constant_amax=10.0)
    q.collect(_data((2, 16), 26))
    with pytest.raises(RuntimeError, match="constant_amax=10.0"):
        q.load_calib_amax()


@pytest.mark.parametrize(
    ("valid", "error", "match"),
    [
        (torch.ones(3, 1, dtype=torch.bool), ValueError, "does not broadcast"),
        (torch.ones(4, 1), TypeError, "bool mask"),
    ],
    ids=["bad-shape", "not-bool"],
)
def test_collect_refuses_bad_mask(valid, error, match):
    with pytest.raises(error, match=match):
        WireQuantizer("fp8").collect(_data((4, 16), 27), valid)


def test_collect_refuses_other_device():
    with pytest.raises(RuntimeError, match=r"move the quantizer first"):
        WireQuantizer("fp8").collect(torch.ones(2, 16, device="meta"))


# -- amax setters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (float("nan"), ValueError, "finite"),
        (float("inf"), ValueError, "finite"),
        (-1.0, ValueError, ">= 0"),
        (torch.ones(2), ValueError, "one value"),
        ("3", TypeError, "number"),
    ],
    ids=["nan", "inf", "negative", "two-values", "string"],
)
def test_load_amax_refuses(value, error, match):
    q = WireQuantizer("fp8")
    with pytest.raises(error, match=match):
        q.load_amax(value)
    assert not q.has_amax


def test_load_amax_against_constant():
    q = WireQuantizer("fp8", constant_amax=5.0)
    q.load_amax(5.0)
    with pytest.raises(ValueError, match="constant_amax=5.0"):
        q.load_amax(6.0)


@pytest.mark.parametrize(
    ("fmt", "value", "match"),
    [("mxfp8", 10.0, "no global amax"), ("fp8", 0.0, "> 0"), ("fp8", float("nan"), "> 0"),
     ("nvfp4", True, "must be a number")],
    ids=["block-format", "zero", "nan", "bool"],
)
def test_constant_amax_refused(fmt, value, match):
    with pytest.raises(ValueError, match=match):
        WireQuantizer(fmt, constant_amax=value)


def test_state_updates_never_reallocate():
    q = WireQuantizer("fp8")
    pointers = {name: buf.data_ptr() for name, buf in q.named_buffers()}
    with q.calibrating():
        q(_data((2, 16), 28))
    q.load_amax(3.0)
    q.load_state_dict(WireQuantizer("fp8", constant_amax=7.0).state_dict())
    assert {name: buf.data_ptr() for name, buf in q.named_buffers()} == pointers


# -- cfg mapping ----------------------------------------------------------------------------

_ACCEPTED = [
    ({"num_bits": (4, 3)}, "fp8"),
    ({"num_bits": [4, 3], "axis": None}, "fp8"),
    ({"num_bits": "e4m3"}, "fp8"),
    ({"num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS}, "nvfp4"),
    ({"num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS, "axis": 0}, "nvfp4_token"),
    ({"num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS, "axis": [-2]}, "nvfp4_token"),
    ({"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}}, "fp8_b128"),
    ({"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic", "scale_bits": [8, 0]}},
     "fp8_b128_ue8m0"),
    ({"num_bits": (4, 3), "block_sizes": MX_BLOCKS}, "mxfp8"),
    ({"num_bits": "e2m1", "block_sizes": {**MX_BLOCKS, "scale_bits": "e8m0"}}, "mxfp4"),
    ({"format": "fp8_b32_ue8m0"}, "fp8_b32_ue8m0"),
    ({"format": "logfmt10"}, "logfmt10"),
    ({"format": "nvfp4", "num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS}, "nvfp4"),
    ({"enable": False}, "bf16"),
]


@pytest.mark.parametrize(("cfg", "name"), _ACCEPTED, ids=[f"{n}-{i}" for i, (_, n) in
                                                          enumerate(_ACCEPTED)])
def test_from_cfg_maps(cfg, name):
    q = WireQuantizer.from_cfg(cfg)
    assert q.fmt is formats.get(name)
    assert q.enabled == cfg.get("enable", True)


@pytest.mark.parametrize("name", formats.names())
def test_each_modelopt_spelling_maps_back_to_its_format(name):
    spelled = formats.get(name).modelopt_cfg()
    if spelled is None:
        assert name not in modelopt_table().values()
    else:
        assert parse_cfg(spelled).fmt == name


def test_a_new_format_declares_its_spelling_in_one_place(monkeypatch):
    """Registering a format with a spelling is all parse_cfg needs to accept it."""
    from moewire.formats import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    class FP6(formats.WireFormat):
        name = "fp6_e3m2"
        element_bits = 6
        modelopt_spelling = formats.ModelOptSpelling(num_bits=(3, 2))

    formats.register(FP6)
    assert parse_cfg({"num_bits": [3, 2]}).fmt == "fp6_e3m2"
    with pytest.raises(CfgError, match="-> fp6_e3m2"):
        parse_cfg({"num_bits": (5, 2)})


def test_from_cfg_options():
    spec = parse_cfg({"num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS, "constant_amax": 2688,
                      "enable": False, "allow_dynamic": False})
    assert spec == QuantizerSpec("nvfp4", 2688.0, False, False)
    q = WireQuantizer.from_cfg({"num_bits": (4, 3), "constant_amax": 12.5}, name="l.dq")
    assert q.constant_amax == 12.5 and q.has_amax and q.name == "l.dq"
    assert not WireQuantizer.from_cfg({"num_bits": (4, 3), "allow_dynamic": False}).allow_dynamic


_REFUSED = [
    ("unknown-key", {"num_bits": (4, 3), "calibrator": "max"}, ("calibrator",),
     "unknown cfg key 'calibrator'; accepted keys: " + ", ".join(CFG_KEYS)),
    ("int8", {"num_bits": 8}, ("num_bits",), "integer quantization"),
    ("bits-triple", {"num_bits": [4, 3, 1]}, ("num_bits",), "not a pair"),
    ("bits-name", {"num_bits": "e5m2"}, ("num_bits",), "not a pair"),
    ("e5m2", {"num_bits": (5, 2)}, ("num_bits",), "name no moewire format; accepted: "),
    ("blocks-not-map", {"num_bits": (4, 3), "block_sizes": 16}, ("block_sizes",), "mapping"),
    ("blocks-2d", {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128, "type": "dynamic"}},
     ("block_sizes", -2), "last dim only"),
    ("blocks-no-size", {"num_bits": (4, 3), "block_sizes": {"type": "dynamic"}},
     ("block_sizes", -1), "block size along the last dim"),
    ("blocks-static", {"num_bits": (2, 1), "block_sizes": {**NVFP4_BLOCKS, "type": "static"}},
     ("block_sizes", "type"), "set type: dynamic"),
    ("blocks-no-type", {"num_bits": (2, 1), "block_sizes": {-1: 16, "scale_bits": (4, 3)}},
     ("block_sizes", "type"), "set type: dynamic"),
    ("block-64", {"num_bits": (2, 1), "block_sizes": {**NVFP4_BLOCKS, -1: 64}},
     ("block_sizes",), "name no moewire format"),
    ("nvfp4-e8m0", {"num_bits": (2, 1), "block_sizes": {**NVFP4_BLOCKS, "scale_bits": (8, 0)}},
     ("block_sizes",), "name no moewire format"),
    ("axis-channel", {"num_bits": (4, 3), "axis": -1}, ("axis",), "per-channel"),
    ("axis-tuple", {"num_bits": (4, 3), "axis": (0, 1)}, ("axis",), "no moewire format"),
    ("fp8-per-token", {"num_bits": (4, 3), "axis": 0}, ("num_bits",), "name no moewire format"),
    ("mx-per-token", {"num_bits": (4, 3), "block_sizes": MX_BLOCKS, "axis": 0},
     ("block_sizes",), "name no moewire format"),
    ("blocks-without-bits", {"block_sizes": NVFP4_BLOCKS}, ("num_bits",), "without num_bits"),
    ("unknown-format", {"format": "fp6"}, ("format",), "not a registered wire format"),
    ("format-disagrees", {"format": "nvfp4", "num_bits": (4, 3)}, ("format",), "disagrees"),
    ("no-format", {"constant_amax": 3.0}, (), "names no format"),
    ("empty", {}, (), "names no format"),
    ("constant-on-mx", {"num_bits": (4, 3), "block_sizes": MX_BLOCKS, "constant_amax": 1.0},
     ("constant_amax",), "no global amax"),
    ("constant-zero", {"num_bits": (4, 3), "constant_amax": 0}, ("constant_amax",), "> 0"),
    ("constant-text", {"num_bits": (4, 3), "constant_amax": "2688"}, ("constant_amax",),
     "must be a number"),
    ("enable-text", {"num_bits": (4, 3), "enable": "yes"}, ("enable",), "true or false"),
    ("dynamic-text", {"num_bits": (4, 3), "allow_dynamic": 1}, ("allow_dynamic",),
     "true or false"),
    ("not-a-dict", [("num_bits", (4, 3))], (), "must be a mapping"),
]


@pytest.mark.parametrize(("cfg", "key", "match"), [r[1:] for r in _REFUSED],
                         ids=[r[0] for r in _REFUSED])
def test_from_cfg_refuses(cfg, key, match):
    with pytest.raises(CfgError) as info:
        WireQuantizer.from_cfg(cfg)
    assert isinstance(info.value, ValueError)
    assert match in str(info.value)
    assert info.value.key == key


def test_unmappable_cfg_lists_every_accepted_spelling():
    with pytest.raises(CfgError) as info:
        parse_cfg({"num_bits": (3, 2)})
    message = str(info.value)
    for name in ("fp8", "nvfp4", "nvfp4_token", "fp8_b128", "fp8_b128_ue8m0", "mxfp8", "mxfp4"):
        assert f"-> {name}" in message
    assert "format: <name>" in message


def test_unknown_format_name_refused():
    with pytest.raises(ValueError, match="unknown wire format 'fp6'"):
        WireQuantizer("fp6")


# -- state -------------------------------------------------------------------------------


def _calibrated(name="nvfp4", seed=30) -> WireQuantizer:
    q = WireQuantizer(name)
    with q.calibrating():
        q(_data((4, 32), seed))
    return q


def test_state_dict_round_trip_restores_amax_and_flags():
    q = _calibrated()
    buffer = io.BytesIO()
    torch.save(q.state_dict(), buffer)
    buffer.seek(0)
    fresh = WireQuantizer("nvfp4")
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    assert fresh.has_amax and fresh.amax_source == "calibrated"
    assert torch.equal(fresh.amax, q.amax) and fresh.amax.dtype == torch.float32
    assert repr(fresh) == repr(q)
    assert set(q.state_dict()) == {"amax", "_extra_state"}


def test_state_dict_round_trip_of_constant_and_empty():
    fresh = WireQuantizer("nvfp4", constant_amax=100.0)
    fresh.load_state_dict(WireQuantizer("nvfp4").state_dict())
    assert not fresh.has_amax and fresh.constant_amax is None
    fresh.load_state_dict(WireQuantizer("nvfp4", constant_amax=2688.0).state_dict())
    assert fresh.constant_amax == 2688.0 and fresh.amax_source == "constant"


def test_load_state_dict_refuses_format_mismatch_before_touching_amax():
    q = _calibrated("fp8")
    model = torch.nn.Module()
    model.dispatch_quantizer = WireQuantizer("nvfp4")
    state = {f"dispatch_quantizer.{k}": v for k, v in q.state_dict().items()}
    with pytest.raises(RuntimeError, match="dispatch_quantizer: the state_dict was saved from a "
                                           "'fp8' quantizer, and this one is 'nvfp4'"):
        model.load_state_dict(state)
    assert float(model.dispatch_quantizer.amax) == 0.0
    assert not model.dispatch_quantizer.has_amax


def test_set_extra_state_refuses_foreign_state_and_bad_amax():
    q = WireQuantizer("fp8")
    with pytest.raises(RuntimeError, match="not a WireQuantizer's"):
        q.set_extra_state({"num_bits": 8})
    q.amax.fill_(float("inf"))
    with pytest.raises(ValueError, match="loaded state.*finite"):
        q.set_extra_state({"format": "fp8", "has_amax": True})


def test_dtype_casts_keep_the_fp32_amax():
    q = _calibrated()
    value = q.amax.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        cast(q)
        assert q.amax.dtype == torch.float32 and torch.equal(q.amax, value)
        assert q.calib_nan.dtype == torch.int64 and q.calib_seen.dtype == torch.bool


def test_to_device_moves_every_buffer():
    q = _calibrated().to("meta")
    assert all(buf.device.type == "meta" for buf in q.buffers())
    assert q.amax.dtype == torch.float32


# -- repr --------------------------------------------------------------------------------


def test_repr_like_modelopt_summary():
    calibrated = WireQuantizer("nvfp4")
    calibrated.collect(torch.tensor([[-2687.5, 2.0]]))
    assert repr(calibrated) == "WireQuantizer(nvfp4, amax=dynamic)"
    calibrated.load_calib_amax()
    assert repr(calibrated) == "WireQuantizer(nvfp4, amax=2.6875e+03, calibrated)"
    assert repr(WireQuantizer("fp8")) == "WireQuantizer(fp8, amax=dynamic)"
    assert repr(WireQuantizer("fp8", enable=False)) == "WireQuantizer(disabled)"
    assert repr(WireQuantizer("nvfp4", constant_amax=2688.0)) == (
        "WireQuantizer(nvfp4, amax=2.6880e+03, constant)")
    assert repr(WireQuantizer("fp8", allow_dynamic=False)) == (
        "WireQuantizer(fp8, amax=None, needs calibration)")
    assert repr(WireQuantizer("mxfp4")) == "WireQuantizer(mxfp4)"
    loaded = WireQuantizer("fp8")
    loaded.load_amax(0.5)
    assert loaded.extra_repr() == "fp8, amax=5.0000e-01, loaded"
    calibrating = WireQuantizer("fp8")
    calibrating.mode = "calibrate"
    assert repr(calibrating) == "WireQuantizer(fp8, calibrating, no data yet)"
    calibrating(torch.tensor([[1.5, -3.0]]))
    assert repr(calibrating) == "WireQuantizer(fp8, calibrating, calib_amax=3.0000e+00)"


def test_repr_inside_a_model():
    model = torch.nn.Module()
    model.combine_quantizer = WireQuantizer("mxfp8")
    assert "(combine_quantizer): WireQuantizer(mxfp8)" in repr(model)


# -- refused loads change nothing; bad arguments are named ----------------------------


@pytest.mark.parametrize("has_amax", [True, False], ids=["with-amax", "without-amax"])
@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -1.0], ids=["nan", "inf", "negative"]
)
def test_load_state_dict_refusal_changes_nothing(has_amax, bad):
    q = WireQuantizer("fp8", name="layers.0.experts.dispatch_quantizer")
    q.load_amax(3.5)
    state = q.state_dict()
    state["amax"] = torch.tensor(bad)
    state["_extra_state"] = dict(state["_extra_state"], has_amax=has_amax)
    with pytest.raises(ValueError, match=r"dispatch_quantizer.*amax is .*finite and >= 0"):
        q.load_state_dict(state)
    assert float(q.amax) == 3.5 and q.has_amax and q.amax_source == "loaded"


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float64],
                         ids=["bool", "int64", "float64"])
def test_load_state_dict_refuses_a_non_fp32_amax(dtype):
    q = WireQuantizer("fp8")
    state = q.state_dict()
    state["amax"] = torch.ones((), dtype=dtype)
    with pytest.raises(ValueError, match=f"saved amax is {dtype}.*FP32"):
        q.load_state_dict(state)
    assert float(q.amax) == 0.0 and not q.has_amax


@pytest.mark.parametrize("value", [1e300, 1e39, 1e-46, 1e-40],
                         ids=["1e300", "above-fp32-max", "below-fp32-subnormal", "fp32-subnormal"])
def test_constant_amax_outside_fp32_is_refused(value):
    with pytest.raises(ValueError, match=r"constant_amax=.* outside FP32's range"):
        WireQuantizer("fp8", constant_amax=value)
    with pytest.raises(CfgError, match="outside FP32's range"):
        parse_cfg({"num_bits": (4, 3), "constant_amax": value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"enable": "no"}, "enable must be True or False"),
     ({"enable": 0}, "enable must be True or False"),
     ({"allow_dynamic": "false"}, "allow_dynamic must be True or False"),
     ({"fmt": 8}, "fmt must be a format name"),
     ({"name": 3}, "name must be a str")],
    ids=["enable-str", "enable-int", "allow-dynamic-str", "fmt-int", "name-int"],
)
def test_constructor_refuses_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        WireQuantizer(**kwargs)


def test_dynamic_amax_with_no_token_returns_the_empty_input():
    q = WireQuantizer("fp8")
    x = torch.zeros((0, 64), dtype=torch.bfloat16)
    out = q(x)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_dynamic_amax_of_a_nan_input_names_the_input_not_calibration():
    q = WireQuantizer("fp8", name="layers.0.experts.dispatch_quantizer")
    x = _data((4, 32), 40)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"dispatch_quantizer: the per-call amax .* x holds "
                                         r"NaN or inf; fix the input") as info:
        q(x)
    assert "calibration data" not in str(info.value).split("(")[0]
