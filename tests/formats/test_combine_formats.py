"""The real-kernel combine formats on crafted blocks, worked out by hand (exact binary
fractions), and the inputs where they part from moewire's older formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moewire import formats

CEIL_FP8 = ["deepgemm_fp8_combine", "trtllm_32e4m3xe8m0", "te_mxfp8"]
REAL = [*CEIL_FP8, "trtllm_16e2m1xbf16"]
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _row(values: list[float], hidden: int = 128, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.zeros(1, hidden, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x.to(dtype)


def _q(name: str, x: torch.Tensor) -> list[float]:
    return formats.get(name).qdq(x)[0].float().tolist()


@pytest.mark.parametrize("name", CEIL_FP8)
def test_ceil_scale_keeps_the_block_max_where_ocp_floor_saturates(name):
    # amax 500: the ceil rules pick 2^1 (500/2 = 250 rounds to 256: 512), OCP's floor picks
    # 2^0 (500 saturates to 448), and so would round(log2(500/448)) = 0.
    x = _row([500.0])
    assert _q(name, x)[0] == 512.0
    assert _q("mxfp8", x)[0] == 448.0


@pytest.mark.parametrize("name", CEIL_FP8)
def test_e4m3_ties_go_to_even(name):
    # amax 272 takes scale 1 (272 / 448 < 1); E4M3's step in [256, 512) is 32, so 272 is
    # half-way between 256 (even mantissa) and 288: it goes to 256; 264 to 256, 280 to 288.
    x = _row([272.0, 264.0, 280.0, -272.0])
    assert _q(name, x)[:4] == [256.0, 256.0, 288.0, -256.0]


@pytest.mark.parametrize("name", REAL)
def test_all_zero_block_stays_zero(name):
    x = _row([0.0, -0.0])
    out = formats.get(name).qdq(x)
    assert not torch.isnan(out).any()
    assert (out == 0).all()


@pytest.mark.parametrize("name", CEIL_FP8)
def test_largest_finite_bf16_rounds_up_to_inf(name):
    # (2 - 2^-7) * 2^127 / 448 -> e = 120; x * 2^-120 = 255 rounds to 256; 256 * 2^120 =
    # 2^128 overflows FP32: the real kernels' dequantization gives inf, OCP's floor does not.
    x = _row([BF16_MAX, 1.0])
    assert _q(name, x)[0] == float("inf")
    assert _q("mxfp8", x)[0] == 448.0 * 2.0**119


def test_deepgemm_keeps_subnormal_blocks_te_and_trtllm_flush_them():
    # A BF16 subnormal block: amax/448 is an FP32 subnormal, fast_log2_ceil gives -126, and
    # 2^-130 * 2^126 = 1/16 is an E4M3 value. TE's byte is 0 (quantized with 1: flushed);
    # TRT-LLM's 1e-30 floor gives 2^-108, under which 2^-130 is below E4M3's 2^-9.
    x = _row([2.0**-130])
    assert _q("deepgemm_fp8_combine", x)[0] == 2.0**-130
    assert _q("te_mxfp8", x)[0] == 0.0
    assert _q("trtllm_32e4m3xe8m0", x)[0] == 0.0


def test_deepgemm_differs_from_fp8_b128_ue8m0_below_its_amax_floor():
    # amax 17 * 2^-24 < 1e-4: DeepGEMM's host cast floors it to 1e-4 (scale 2^-22), the
    # combine does not (scale 2^-28). 1.25 * 2^-31 is exact under 2^-28 (0.15625 = 1.25 *
    # 2^-3) but rounds to 2^-31 under 2^-22 (1.25 * 2^-9 on E4M3's subnormal step 2^-9).
    x = _row([17 * 2.0**-24, 1.25 * 2.0**-31])
    assert _q("deepgemm_fp8_combine", x)[:2] == [17 * 2.0**-24 * 256 / 272, 1.25 * 2.0**-31]
    assert _q("fp8_b128_ue8m0", x)[1] == 2.0**-31


def test_deepgemm_equals_fp8_b128_ue8m0_above_the_floor():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 1024, generator=g) * 3).bfloat16()
    assert torch.equal(formats.get("deepgemm_fp8_combine").qdq(x),
                       formats.get("fp8_b128_ue8m0").qdq(x))


def test_trtllm_and_te_mxfp8_part_below_trtllm_amax_floor():
    # amax 1.25 * 2^-116 (~1.5e-35 < 1e-30): TRT-LLM scales by 2^-108 (1.25 * 2^-8 is a tie
    # between 2 and 3 subnormal steps 2^-9: to 2, i.e. 2^-116); TE by 2^-124 (exact: 320).
    x = _row([1.25 * 2.0**-116], hidden=32)
    assert _q("trtllm_32e4m3xe8m0", x)[0] == 2.0**-116
    assert _q("te_mxfp8", x)[0] == 1.25 * 2.0**-116


def test_trtllm_and_te_mxfp8_agree_on_ordinary_blocks():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 1024, generator=g) * torch.logspace(-6, 6, 8).unsqueeze(1)).bfloat16()
    assert torch.equal(formats.get("trtllm_32e4m3xe8m0").qdq(x), formats.get("te_mxfp8").qdq(x))


def test_exact_power_of_two_scale_is_not_rounded_up():
    # amax such that amax * fl(1/448) is exactly 2^-3: ceil keeps 2^-3, so amax maps to 448.
    inv = np.float32(1) / np.float32(448)
    amax = float(np.float32(0.125) / inv)
    assert np.float32(amax) * inv == np.float32(0.125)
    x = _row([amax], dtype=torch.float32)
    for name in CEIL_FP8:
        got = _q(name, x)[0]
        assert got == float(np.float32(448.0 * 0.125)), name


def test_fp4_dequantized_value_needs_fp32():
    # amax 7: ds = fl(7 * fl(1/6)), enc = fl(1/ds); 7 * enc goes to 6; 6 * ds is an FP32
    # number with more than 8 significant bits, which a QDQ to BF16 would round.
    f32 = np.float32
    ds = f32(7.0) * (f32(1) / f32(6))
    enc = f32(1) / ds
    assert f32(5.0) < f32(f32(7.0) * enc) <= f32(6.0)  # E2M1 rounds it to 6
    want = float(f32(6.0) * ds)
    x = _row([7.0, 3.5, 0.5833333], hidden=16)
    fmt = formats.get("trtllm_16e2m1xbf16")
    got = fmt.dequantize(x)[0]
    assert got.dtype == torch.float32 and float(got[0]) == want
    assert float(torch.tensor(want).bfloat16()) != want
    assert float(fmt.qdq(x)[0, 0]) == float(torch.tensor(want).bfloat16())


def test_fp4_ties_go_to_even_and_zeros_are_positive():
    # amax 6 -> ds = 1 exactly, enc = 1: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4; -0.1 -> +0.0 (the table lists +0 first).
    x = _row([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -3.5], hidden=16)
    out = formats.get("trtllm_16e2m1xbf16").qdq(x)[0]
    assert out[:10].float().tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0]
    assert not torch.signbit(out[8])


@pytest.mark.parametrize("name", REAL)
def test_nonfinite_block_is_nan_and_other_blocks_untouched(name):
    fmt = formats.get(name)
    x = torch.ones(1, 256)
    x[0, 0] = float("inf")
    out = fmt.qdq(x)
    assert torch.isnan(out[0, : fmt.block_size]).all()
    assert (out[0, fmt.block_size:] == 1.0).all()


@pytest.mark.parametrize("name", REAL)
def test_real_formats_accumulate_in_fp32(name):
    assert formats.get(name).combine_accumulate == "fp32"
    assert formats.get("nvfp4").combine_accumulate == "bf16"
