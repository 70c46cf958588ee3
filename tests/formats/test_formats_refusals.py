"""Every bad input is refused with an error that names the format, the cause and the fix."""

from __future__ import annotations

import zlib

import pytest
import torch

import moewire
from moewire import formats

BLOCKED = [n for n in formats.names() if formats.get(n).block_size is not None]
NEEDS_AMAX = [n for n in formats.names() if formats.get(n).needs_amax]


@pytest.mark.parametrize(
    "name", ["nope", "FP8", "", None, 3], ids=["nope", "FP8", "empty", "None", "int"]
)
def test_unknown_format(name):
    with pytest.raises(ValueError, match="unknown wire format.*known formats: bf16"):
        formats.get(name)
    with pytest.raises(ValueError, match="unknown wire format"):
        moewire.fake_quant(torch.zeros(4), name)


@pytest.mark.parametrize("name", BLOCKED)
def test_last_dim_not_a_multiple_of_the_block(name):
    fmt = formats.get(name)
    x = torch.randn(2, fmt.block_size + fmt.block_size // 2)
    with pytest.raises(ValueError, match=f"{name}.*not a multiple of the block size"):
        fmt.qdq(x, 1.0)


@pytest.mark.parametrize(
    "dtype",
    [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64, torch.float8_e4m3fn],
    ids=["int32", "int64", "uint8", "bool", "float64", "float8"],
)
@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4"])
def test_unsupported_dtype(name, dtype):
    x = torch.zeros(2, 128).to(dtype)
    with pytest.raises(ValueError, match=f"{name}.*dtype.*bfloat16, float16 or float32"):
        formats.get(name).qdq(x, 1.0)


@pytest.mark.parametrize("bad", [[1.0, 2.0], "x", None], ids=["list", "str", "None"])
def test_not_a_tensor(bad):
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        formats.get("mxfp8").qdq(bad)


def test_zero_dim_tensor():
    with pytest.raises(ValueError, match="0-d tensor"):
        formats.get("bf16").qdq(torch.tensor(1.0))


@pytest.mark.parametrize("name", NEEDS_AMAX)
def test_amax_missing(name):
    with pytest.raises(ValueError, match=f"{name}.*needs an amax"):
        formats.get(name).qdq(torch.randn(2, 64))


@pytest.mark.parametrize(
    "amax",
    [
        -1.0,
        float("nan"),
        float("inf"),
        -float("inf"),
        torch.tensor(float("nan")),
        torch.tensor([-2.0]),
    ],
    ids=["negative", "nan", "inf", "-inf", "nan-tensor", "negative-tensor"],
)
@pytest.mark.parametrize("name", NEEDS_AMAX)
def test_amax_bad_value(name, amax):
    with pytest.raises(ValueError, match=f"{name}.*amax is .*finite and >= 0"):
        formats.get(name).qdq(torch.randn(2, 64), amax)


@pytest.mark.parametrize(
    "amax",
    [torch.tensor([1.0, 2.0]), torch.ones(2, 2), torch.tensor([])],
    ids=["two-elements", "2x2", "empty"],
)
@pytest.mark.parametrize("name", NEEDS_AMAX)
def test_amax_not_a_scalar(name, amax):
    with pytest.raises(ValueError, match=f"{name}.*amax must be a scalar"):
        formats.get(name).qdq(torch.randn(2, 64), amax)


@pytest.mark.parametrize(
    "amax", ["1.0", True, torch.tensor(1 + 2j)], ids=["str", "bool", "complex"]
)
@pytest.mark.parametrize("name", NEEDS_AMAX)
def test_amax_wrong_type(name, amax):
    with pytest.raises(TypeError, match=f"{name}.*amax"):
        formats.get(name).qdq(torch.randn(2, 64), amax)


@pytest.mark.parametrize("amax", [torch.tensor([2.0]), torch.tensor(2, dtype=torch.int32), 2])
def test_amax_accepted_forms(amax):
    x = torch.randn(2, 64)
    assert torch.equal(formats.get("fp8").qdq(x, amax), formats.get("fp8").qdq(x, 2.0))


def test_formats_without_amax_ignore_it():
    x = torch.randn(2, 64)
    fmt = formats.get("mxfp4")
    assert torch.equal(fmt.qdq(x, float("nan")), fmt.qdq(x))


def test_register_refuses_duplicates_and_empty_names():
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.get("fp8"))

    class Nameless(formats.WireFormat):
        pass

    with pytest.raises(ValueError, match="non-empty name"):
        formats.register(Nameless)


def test_register_refuses_a_modelopt_spelling_another_format_has():
    class FP8Again(formats.WireFormat):
        name = "fp8_again"
        needs_amax = True
        modelopt_spelling = formats.ModelOptSpelling(num_bits=(4, 3))

    with pytest.raises(ValueError, match="'fp8' already has, so a ModelOpt cfg could not tell"):
        formats.register(FP8Again)
    assert "fp8_again" not in formats.names()


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.int32], ids=["bf16", "fp16", "int32"]
)
def test_mul_recip_refuses_other_dtypes(dtype):
    from moewire.formats._numerics import mul_recip

    with pytest.raises(TypeError, match="mul_recip: t must be float32 or float64"):
        mul_recip(torch.ones(4).to(dtype), 448.0)


@pytest.mark.parametrize(
    "divisor", [0.0, -448.0, 1.5, 2.0**24, float("inf")],
    ids=["zero", "negative", "fraction", "2^24", "inf"],
)
def test_mul_recip_refuses_divisors_not_exact_integers(divisor):
    from moewire.formats._numerics import mul_recip

    with pytest.raises(ValueError, match="positive integer below 2\\^24"):
        mul_recip(torch.ones(4), divisor)


# -- FP16 saturation: a finite FP16 input never comes back as inf ----------------------------


def _fp16_near_max(seed: int) -> torch.Tensor:
    """FP16 rows [4, 256] of random values whose largest ones sit at or near 65504."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 256, generator=g) * 2000
    x[:, ::7] = torch.tensor([65504.0, -65504.0, 65408.0, -65312.0]).repeat(37)[:37]
    return x.to(torch.float16)


@pytest.mark.parametrize("name", formats.names())
def test_fp16_input_saturates_at_the_fp16_max(name):
    fmt = formats.get(name)
    x = _fp16_near_max(zlib.crc32(name.encode()))
    out = fmt.qdq(x, 65504.0)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all(), f"{name}: a finite FP16 input came back as inf"
    # Only the overflowing values change: below FP16's max the result is the format's own.
    ref = fmt.reference(x, torch.tensor(65504.0) if fmt.needs_amax else None)
    fine = torch.isfinite(ref)
    assert torch.equal(out[fine], ref[fine])
    assert torch.equal(out[~fine].abs(), torch.full_like(out[~fine], 65504.0))


def test_fp16_saturation_keeps_inf_and_nan_inputs():
    x = torch.tensor([65504.0, float("inf"), -float("inf"), float("nan")], dtype=torch.float16)
    out = formats.get("bf16").qdq(x)
    assert out[0] == 65504.0 and out[1] == float("inf") and out[2] == -float("inf")
    assert torch.isnan(out[3])
