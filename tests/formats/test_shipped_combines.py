"""FlashInfer's and MoRI's combines and ``fp8_e4m3fnuz`` on crafted blocks, worked out by
hand (exact binary fractions; FP32 steps where a value is not one), and the inputs where
they part from the formats they resemble."""

from __future__ import annotations

import fmt_oracle
import numpy as np
import pytest
import torch

from moewire import formats

F32 = np.float32
MORI = ["mori_fp8_blockwise_fnuz", "mori_fp8_blockwise_ocp", "mori_fp8_direct_cast_fnuz",
        "mori_fp8_direct_cast_ocp"]
SHIPPED = ["flashinfer_mxfp8", "flashinfer_nvfp4", *MORI]
BLOCKED = ["flashinfer_mxfp8", "flashinfer_nvfp4", "mori_fp8_blockwise_fnuz",
           "mori_fp8_blockwise_ocp"]


def _row(values: list[float], hidden: int = 128, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.zeros(1, hidden, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x.to(dtype)


def _q(name: str, x: torch.Tensor, amax=None) -> list[float]:
    return formats.get(name).qdq(x, amax)[0].float().tolist()


def _agrees_with_oracle(name: str, x: torch.Tensor, amax=None) -> None:
    fmt_oracle.assert_bits_equal(formats.get(name).qdq(x, amax),
                                 fmt_oracle.expected(name, x, amax), name)


# -- FlashInfer's MXFP8 combine (32e4m3xe8m0) -----------------------------------------------


@pytest.mark.parametrize(
    "amax_exp,byte,want_q",
    [(-91, 28, 256.0), (-92, 27, 208.0), (-95, 24, 26.0)],
    ids=["byte28-unmasked", "byte27-masked", "byte24-masked"],
)
def test_flashinfer_mxfp8_masks_the_reciprocal_of_tiny_blocks(amax_exp, byte, want_q):
    # amax 2^k: c = 2^k * fl(1/448) rounds up to 2^(k - 8), byte k - 8 + 127. At byte 28 the
    # mask fl(2^-99 * 1e30) = 1.58 is clipped to 1 and enc = 2^99: 2^-91 -> 256 -> exact.
    # At byte 27 (sf = 2^-100) enc = 1e30 (FP32), and 2^-92 * 1e30 = 201.95 rounds to 208
    # (E4M3's step 16 in [128, 256)); at byte 24 2^-95 * 1e30 = 25.24 rounds to 26 (step 2).
    # TE's rule has no mask: the power of two comes back exactly.
    amax = 2.0**amax_exp
    sf = 2.0 ** (byte - 127)
    x = _row([amax, -amax / 2], hidden=32)
    got = _q("flashinfer_mxfp8", x)
    assert got[0] == want_q * sf
    assert _q("te_mxfp8", x)[:2] == [amax, -amax / 2]
    _agrees_with_oracle("flashinfer_mxfp8", x)


def test_flashinfer_mxfp8_byte_zero_blocks_are_zeros_with_their_signs():
    # amax <= 448 * 2^-127: sf = 2^-127 is an FP32 subnormal, rcp.approx.ftz flushes it and
    # every element encodes to a signed zero.
    x = _row([2.0**-120, -(2.0**-121)], hidden=32, dtype=torch.float32)
    out = formats.get("flashinfer_mxfp8").qdq(x)
    assert (out == 0).all() and torch.signbit(out[0, 1]) and not torch.signbit(out[0, 0])
    _agrees_with_oracle("flashinfer_mxfp8", x)


def test_flashinfer_mxfp8_reads_the_block_amax_as_bf16():
    # FP32 amax 449 is 448 in BF16: FlashInfer's c = 448 * fl(1/448) rounds to at most 1,
    # scale 2^0; TE's 449 * fl(1/448) > 1, scale 2^1. 2^-9 is E4M3's smallest subnormal
    # under 2^0, and a tie between 0 and 2^-9 under 2^1 (to even: 0).
    x = _row([449.0, 2.0**-9], hidden=32, dtype=torch.float32)
    assert _q("flashinfer_mxfp8", x)[1] == 2.0**-9
    assert _q("te_mxfp8", x)[1] == 0.0
    _agrees_with_oracle("flashinfer_mxfp8", x)


def test_flashinfer_mxfp8_saturates_the_scale_of_an_amax_that_rounds_to_bf16_infinity():
    # 0x7F7F8000 (about 3.3962e38) is the tie between BF16's largest finite and 2^128: the
    # BF16 amax is +inf, c = inf, and cvt.rp.satfinite gives byte 254 (sf 2^127), not the
    # 127 a finite-only ceil(log2) would give. x * 2^-127 = 1.99609375 rounds to E4M3's 2,
    # so q * sf = 2^128 overflows to inf; 1.5 * 2^127 decodes exactly; 1.0 is below half
    # of E4M3's smallest subnormal at that scale and is 0.
    big = float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))
    x = _row([big, -1.5 * 2.0**127, 1.0], hidden=32, dtype=torch.float32)
    assert _q("flashinfer_mxfp8", x)[:3] == [float("inf"), -1.5 * 2.0**127, 0.0]
    _agrees_with_oracle("flashinfer_mxfp8", x)


def test_flashinfer_mxfp8_equals_te_mxfp8_on_ordinary_bf16_rows():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(8, 1024, generator=g) * torch.logspace(-20, 6, 8).unsqueeze(1)).bfloat16()
    assert torch.equal(formats.get("flashinfer_mxfp8").qdq(x), formats.get("te_mxfp8").qdq(x))


# -- FlashInfer's NVFP4 combine (16e2m1xbf16) -----------------------------------------------


def test_flashinfer_nvfp4_masks_the_reciprocal_below_6e_30():
    # amax 3 * 2^-100 (2.4e-30): ds = fl(amax * fl(1/6)) is about 3.9e-31, the mask
    # fl(ds * 1e30) about 0.39, so enc is about 0.39 / ds and the amax encodes to about
    # 6 * 0.39 = 2.37, which E2M1 rounds to 2: it decodes to 2 * ds, a third of itself.
    # TensorRT-LLM's host oracle (no mask) gives 6 * ds, the amax.
    amax = 3 * 2.0**-100
    ds = F32(F32(amax) * (F32(1) / F32(6)))
    mask = F32(ds * F32(1e30))
    assert 0.39 < mask < 0.4
    x = _row([amax], hidden=16)
    assert _q("flashinfer_nvfp4", x)[0] == float(torch.tensor(float(F32(2) * ds)).bfloat16())
    assert _q("trtllm_16e2m1xbf16", x)[0] == float(torch.tensor(float(F32(6) * ds)).bfloat16())
    _agrees_with_oracle("flashinfer_nvfp4", x)


def test_flashinfer_nvfp4_keeps_the_sign_of_a_zero():
    # amax 6: ds = fl(6 * fl(1/6)) = 1 and enc = 1; -0.1 rounds to E2M1's zero and keeps its
    # sign (the hardware convert), where the host oracle's table writes +0.0.
    x = _row([6.0, -0.1, 0.1, -0.0], hidden=16, dtype=torch.float32)
    fi = formats.get("flashinfer_nvfp4").qdq(x)[0]
    tr = formats.get("trtllm_16e2m1xbf16").qdq(x)[0]
    assert fi[:4].tolist() == [6.0, 0.0, 0.0, 0.0] and tr[:4].tolist() == [6.0, 0.0, 0.0, 0.0]
    assert torch.signbit(fi[1]) and torch.signbit(fi[3]) and not torch.signbit(fi[2])
    assert not torch.signbit(tr[1])
    _agrees_with_oracle("flashinfer_nvfp4", x)


def test_flashinfer_nvfp4_equals_trtllm_fp4_on_ordinary_rows_but_for_zero_signs():
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(8, 1024, generator=g) * torch.logspace(-20, 6, 8).unsqueeze(1)).bfloat16()
    fi = formats.get("flashinfer_nvfp4").qdq(x)
    tr = formats.get("trtllm_16e2m1xbf16").qdq(x)
    assert torch.equal(fi, tr)  # by value: -0.0 == +0.0
    assert (torch.signbit(fi) != torch.signbit(tr)).any()


# -- MoRI's FP8 combines ---------------------------------------------------------------------


@pytest.mark.parametrize("name,small,want", [
    ("mori_fp8_blockwise_fnuz", 0.001, 2.0**-10),  # FNUZ's subnormal step 2^-10
    ("mori_fp8_blockwise_ocp", 0.001, 2.0**-9),    # OCP E4M3's 2^-9 (0.512 steps -> 1)
    ("mori_fp8_blockwise_fnuz", 2.0**-11, 0.0),    # a tie between 0 and 2^-10: to even
    ("mori_fp8_blockwise_ocp", 3 * 2.0**-10, 2.0**-8),  # 1.5 steps of 2^-9: to 2 steps
])
def test_mori_blockwise_casts_a_block_within_range_without_a_scale(name, small, want):
    # amax 100 <= M: no scale (1.0), the block is cast as it is and its small values land
    # in the FP8 subnormals; a scaled format (fp8_b128: amax / 448) would keep them.
    x = _row([100.0, small], dtype=torch.float32)
    assert _q(name, x)[:2] == [96.0, want]
    assert _q("fp8_b128", x)[1] != want
    _agrees_with_oracle(name, x)


def test_mori_blockwise_scales_an_overflowing_block_down():
    # FNUZ, amax 300 > 240: inv = fl(240 / 300) = 0.8 (FP32), s = fl(300 * fl(1/240)); the
    # amax becomes fl(300 * inv) = 240, decoded fl(240 * s); 75 -> 60 exactly, 60 * s.
    # OCP: 300 <= 448, cast as it is: E4M3's step 32 in [256, 512) gives 288.
    x = _row([300.0, 75.0], dtype=torch.float32)
    inv = F32(240) / F32(300)
    s = F32(F32(300) * (F32(1) / F32(240)))
    assert F32(F32(300) * inv) == 240 and F32(F32(75) * inv) == 60
    got = _q("mori_fp8_blockwise_fnuz", x)
    assert got[:2] == [float(F32(240) * s), float(F32(60) * s)]
    assert got[0] != 300.0  # s is not 1.25 in FP32
    assert _q("mori_fp8_blockwise_ocp", x)[0] == 288.0
    _agrees_with_oracle("mori_fp8_blockwise_fnuz", x)


@pytest.mark.parametrize("fp8_type", ["fnuz", "ocp"])
def test_mori_direct_cast_saturates_rounds_to_even_and_maps_infinities_to_nan(fp8_type):
    name = f"mori_fp8_direct_cast_{fp8_type}"
    x = torch.tensor([[1e4, -1e4, 232.0, 233.0, 2.0**-11, 3 * 2.0**-11, float("inf"),
                       -float("inf"), -0.0, -(2.0**-12)]])
    got = formats.get(name).qdq(x)[0]
    if fp8_type == "fnuz":
        # 232 is the midpoint of 224 (even) and 240; 2^-11 of 0 and 2^-10; 3 * 2^-11 of
        # one and two subnormal steps (even: two).
        want = [240.0, -240.0, 224.0, 240.0, 0.0, 2.0**-9]
    else:
        # 232 and 233 lie between 224 and 240 on E4M3's step 16: 224 (even), 240; 2^-11 is a
        # quarter of E4M3's subnormal step 2^-9 (to 0), 3 * 2^-11 three quarters (to 2^-9).
        want = [448.0, -448.0, 224.0, 240.0, 0.0, 2.0**-9]
    assert got[:6].tolist() == want
    assert torch.isnan(got[6:8]).all()
    # FNUZ has no negative zero; OCP E4M3 keeps it.
    assert torch.signbit(got[8:]).tolist() == ([False, False] if fp8_type == "fnuz"
                                                else [True, True])
    _agrees_with_oracle(name, x)


def test_mori_direct_cast_flushes_rows_below_the_fp8_subnormals():
    # No scale: a row of 1e-4 values is below FNUZ's 2^-11 half step and OCP's 2^-10.
    x = torch.full((1, 64), 1e-4)
    for name in ("mori_fp8_direct_cast_fnuz", "mori_fp8_direct_cast_ocp"):
        assert (formats.get(name).qdq(x) == 0).all(), name


# -- fp8_e4m3fnuz ---------------------------------------------------------------------------


def test_fp8_e4m3fnuz_saturates_at_240_over_s_and_has_no_negative_zero():
    # amax 2: s = 240 * fl(1/2) = 120 (exact), 1/s = fl(1/120). 3 saturates to 240 / 120;
    # 0.25 -> 30 exactly; 1/512 -> 0.234375 = 1.875 * 2^-3 (exact); -1e-7 -> -1.2e-5 ->
    # FNUZ's zero, +0.0; -0.0 -> +0.0.
    x = torch.tensor([[3.0, 0.25, 2.0**-9, -1e-7, -0.0, -3.0]])
    inv_s = F32(1) / F32(120)
    got = formats.get("fp8_e4m3fnuz").qdq(x, 2.0)[0]
    assert got.tolist() == [float(F32(240) * inv_s), float(F32(30) * inv_s),
                            float(F32(0.234375) * inv_s), 0.0, 0.0, float(F32(-240) * inv_s)]
    assert not torch.signbit(got[3:5]).any()
    _agrees_with_oracle("fp8_e4m3fnuz", x, 2.0)


def test_fp8_e4m3fnuz_has_fnuz_steps_where_fp8_has_e4m3_steps():
    # amax 240 and 448 make both scales about 1: 0.0009765625 = 2^-10 is FNUZ's smallest
    # subnormal (kept) and half of E4M3's 2^-9 (a tie, to 0).
    x = torch.tensor([[2.0**-10, 1.0]])
    assert formats.get("fp8_e4m3fnuz").qdq(x, 240.0)[0, 0] != 0
    assert formats.get("fp8").qdq(x, 448.0)[0, 0] == 0


# -- shared facts ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", BLOCKED)
def test_nonfinite_block_is_nan_and_other_blocks_untouched(name):
    fmt = formats.get(name)
    x = torch.ones(1, 256)
    x[0, 0] = float("inf")
    out = fmt.qdq(x)
    assert torch.isnan(out[0, : fmt.block_size]).all()
    assert (out[0, fmt.block_size:] == 1.0).all()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_combines_accumulate_in_fp32(name):
    assert formats.get(name).combine_accumulate == "fp32"
    assert formats.get("fp8_e4m3fnuz").combine_accumulate == "bf16"


@pytest.mark.parametrize(
    ("name", "match"),
    [("mxfp4", "element must be 'e4m3' or 'e4m3fnuz', got 'e2m1'"),
     ("mori_x", "no row for wire format 'mori_x'")],
    ids=["not-fp8", "no-row"],
)
def test_mori_fp8_type_is_checked(name, match):
    """A MoRI format's FP8 type is its row's element: a row of another element, or none, is
    refused."""
    from moewire.formats.mori import MoRIFP8Blockwise, MoRIFP8DirectCast

    for cls in (MoRIFP8Blockwise, MoRIFP8DirectCast):
        with pytest.raises(ValueError, match=match):
            cls(name)
