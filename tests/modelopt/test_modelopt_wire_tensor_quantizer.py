"""WireTensorQuantizer: a ModelOpt TensorQuantizer with moewire's math and quantizer surface."""

import pytest
import torch

pytestmark = pytest.mark.modelopt
# Not "modelopt": pytest puts tests/ on sys.path, where tests/modelopt/ would pass for it.
pytest.importorskip("modelopt.torch.quantization")

from modelopt.torch.quantization.config import QuantizerAttributeConfig  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations.modelopt import BACKEND, WireTensorQuantizer, format_name  # noqa: E402
from moewire.quantizer import WireQuantizerLike  # noqa: E402

FP8 = {"num_bits": (4, 3)}
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
MXFP8 = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
INT8 = {"num_bits": 8}


def _wtq(cfg: dict) -> WireTensorQuantizer:
    return WireTensorQuantizer(QuantizerAttributeConfig(**cfg))


def _x(seed: int, shape=(8, 64), dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (FP8, "fp8"),
        (NVFP4, "nvfp4"),
        ({**FP8, "axis": 0}, None),
        ({**NVFP4, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (4, 3)}}, None),
        (MXFP8, "mxfp8"),
        (INT8, None),
        ({**FP8, "type": "dynamic"}, None),
    ],
    ids=["fp8", "nvfp4", "fp8-per-channel", "nvfp4-block32", "mxfp8", "int8", "fp8-dynamic"],
)
def test_format_name(cfg, expected):
    assert format_name(_wtq(cfg)) == expected


@pytest.mark.parametrize(
    ("cfg", "math"),
    [
        (FP8, "moewire"),
        (NVFP4, "moewire"),
        (INT8, "modelopt"),
        (MXFP8, "modelopt"),
        ({**FP8, "backend_extra_args": {"math": "modelopt"}}, "modelopt"),
        ({**NVFP4, "backend": BACKEND}, "moewire"),
        ({**MXFP8, "backend_extra_args": {"math": "moewire"}}, "moewire"),
    ],
    ids=["fp8", "nvfp4", "int8", "mxfp8", "fp8-asks-modelopt", "nvfp4-backend",
         "mxfp8-asks-moewire"],
)
def test_math_choice(cfg, math):
    q = _wtq(cfg)
    assert q.math == math
    assert (q.fmt is None) == (math == "modelopt")


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({**INT8, "backend_extra_args": {"math": "moewire"}}, "name no moewire format"),
        ({**INT8, "backend": BACKEND}, "name no moewire format"),
        ({**FP8, "backend_extra_args": {"math": "triton"}}, "use 'moewire'"),
    ],
    ids=["int8-asks-moewire", "int8-backend-moewire", "unknown-math"],
)
def test_math_refusals(cfg, match):
    with pytest.raises(ValueError, match=match):
        _ = _wtq(cfg).math


def test_use_constant_amax_pins_448_as_constant_amax_does():
    x = _x(8) * 40
    q = _wtq({**FP8, "use_constant_amax": True})
    assert q.math == "moewire" and q.constant_amax == 448.0 and q.amax_source == "constant"
    assert q.static_amax.dtype == torch.float32 and float(q.static_amax) == 448.0
    with q.calibrating():
        q(x * 100)
    assert float(q.static_amax) == 448.0 and not q.calibratable
    assert torch.equal(q(x), moewire.WireQuantizer("fp8", constant_amax=448.0)(x))


def test_backend_refuses_unknown_format_on_plain_tensor_quantizer():
    tq = TensorQuantizer(QuantizerAttributeConfig(**INT8, backend=BACKEND))
    tq.amax = torch.tensor(2.0)
    with pytest.raises(ValueError, match="name no moewire format"):
        tq(_x(0))


def test_mode_follows_modelopt_flags():
    q = _wtq(FP8)
    assert q.mode == "quantize"
    q.disable_quant()
    q.enable_calib()
    assert q.mode == "calibrate"
    q.disable_calib()
    assert q.mode == "disabled"  # ModelOpt's "quant off" for constant-amax during calibration
    q.enable_quant()
    q.disable()
    assert q.mode == "disabled"


@pytest.mark.parametrize(
    ("cfg", "amax", "static"),
    [
        (FP8, None, False),
        (FP8, 3.0, True),
        ({**NVFP4, "constant_amax": 2688.0}, None, True),
        (NVFP4, None, False),
        (MXFP8, None, True),
        (INT8, None, False),
        (INT8, 2.0, True),
    ],
    ids=["fp8-uncalibrated", "fp8-amax", "nvfp4-constant", "nvfp4-uncalibrated", "mxfp8",
         "int8-uncalibrated", "int8-amax"],
)
def test_is_static_scale(cfg, amax, static):
    q = _wtq(cfg)
    if amax is not None:
        q.amax = torch.tensor(amax)
    assert q.is_static_scale() is static
    assert q.has_amax is (static and cfg is not MXFP8)


@pytest.mark.parametrize("cfg,name", [(FP8, "fp8"), (NVFP4, "nvfp4")], ids=["fp8", "nvfp4"])
def test_forward_is_moewire_format_with_the_quantizer_amax(cfg, name):
    x = _x(1, (16, 64))
    q = _wtq(cfg)
    q.amax = torch.tensor(5.5)
    out = q(x)
    assert out.dtype == x.dtype
    assert torch.equal(out, moewire.fake_quant(x, name, torch.tensor(5.5)))
    assert not torch.equal(out, x)
    assert torch.equal(q(out), out)  # idempotent with a fixed scale


def test_backend_on_plain_tensor_quantizer_is_moewire_math():
    """``backend: "moewire"`` makes NVFP4 run on CPU, where ModelOpt's own asserts CUDA."""
    x = _x(2, (8, 32))
    tq = TensorQuantizer(QuantizerAttributeConfig(**NVFP4, backend=BACKEND))
    tq.amax = torch.tensor(9.0)
    assert torch.equal(tq(x), moewire.fake_quant(x, "nvfp4", torch.tensor(9.0)))
    plain = TensorQuantizer(QuantizerAttributeConfig(**NVFP4))
    plain.amax = torch.tensor(9.0)
    with pytest.raises(AssertionError, match="CUDA"):
        plain(x)


def test_mx_on_request_runs_moewire_math_on_cpu():
    """ModelOpt 0.47's MX fake quant needs its CUDA extension; moewire's runs anywhere."""
    x = _x(6, (8, 64))
    q = _wtq({**MXFP8, "backend_extra_args": {"math": "moewire"}})
    assert q.is_static_scale()
    assert torch.equal(q(x), moewire.fake_quant(x, "mxfp8"))


def test_modelopt_math_is_tensor_quantizer_math():
    x = _x(3, (8, 64))
    ours = _wtq({**INT8})
    ours.amax = torch.tensor(4.0)
    theirs = TensorQuantizer(QuantizerAttributeConfig(**INT8))
    theirs.amax = torch.tensor(4.0)
    assert torch.equal(ours(x), theirs(x))


def test_calibrating_collects_max_and_passes_values_through():
    q = _wtq(FP8)
    a, b = _x(4), _x(5) * 7
    with q.calibrating():
        assert torch.equal(q(a), a)
        assert torch.equal(q(b), b)
        q.collect(a[:0])  # an empty batch (no valid row) adds nothing
    expected = torch.maximum(a.abs().max(), b.abs().max()).float()
    assert q._amax.dtype == torch.float32  # the buffer itself, not a cast per call
    assert torch.equal(q.static_amax, expected)
    assert q.mode == "quantize" and q.is_static_scale()


def test_calibrating_on_no_rows_gives_amax_zero():
    """An idle EP rank ends calibration with amax 0, not without one (ModelOpt PR #2767)."""
    q = _wtq(NVFP4)
    x = _x(7)
    with q.calibrating():
        q.collect(x[:0])
    assert q.has_amax and float(q.static_amax) == 0.0


def test_wire_tensor_quantizer_implements_the_contract():
    members = [n for n in vars(WireQuantizerLike) if not n.startswith("_") or n == "__call__"]
    q = _wtq(FP8)
    assert len(members) == 14 and [n for n in members if not hasattr(q, n)] == []


def test_calibrating_does_not_nest():
    q = _wtq(FP8)
    with q.calibrating():
        q(_x(1))
        with pytest.raises(RuntimeError, match="does not nest"), q.calibrating():
            pass
    assert q.mode == "quantize" and q.has_amax


def test_calibrating_starts_from_a_fresh_max():
    q = _wtq(FP8)
    q.collect(_x(2) * 1000)  # collected before: not part of this calibration
    a = _x(3)
    with q.calibrating():
        q(a)
    assert float(q.static_amax) == float(a.float().abs().max())


def test_calibrating_keeps_a_constant_amax():
    q = _wtq({**NVFP4, "constant_amax": 2688.0})
    with q.calibrating():
        q(_x(4) * 1e4)
    assert float(q.static_amax) == 2688.0 and q.amax_source == "constant"

