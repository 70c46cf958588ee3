"""AMD's Mega-MoE combine, ``flydsl_fp8_blockwise_1x32``: the scale rule, the OCP element,
the signed zeros of byte 0, the weighting before the cast and the FP32 top-k sum, each on
blocks worked out by hand or against the NumPy/ml_dtypes oracle (``fmt_oracle``), with data
where the neighbouring readings give other bits."""

from __future__ import annotations

import fmt_oracle
import ml_dtypes
import numpy as np
import pytest
import torch

from bitexact import assert_same_bits, seed_of
from moewire import cli, formats
from moewire.format_table import FORMATS
from moewire.formats import flydsl
from moewire.megamoe.resum import resum

NAME = "flydsl_fp8_blockwise_1x32"
F32 = np.float32


def _row(values: list[float], hidden: int = 32, dtype=torch.float32) -> torch.Tensor:
    x = torch.zeros(1, hidden, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x.to(dtype)


def _qdq(name: str, x: torch.Tensor) -> torch.Tensor:
    out = formats.get(name).qdq(x)
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected(name, x), name)
    return out[0]


def test_the_row_is_ocp_e4m3_with_an_e8m0_byte_per_32_and_fp32_accumulation():
    row = FORMATS[NAME]
    assert (row.element, row.block_size, row.scale, row.scale_bits) == (
        "e4m3", 32, "block_ue8m0", 8)
    assert row.combine_accumulate == "fp32" and not row.needs_amax and row.row_local
    assert formats.get(NAME).wire_bits(7168) / 7168 == 8.25


def test_the_scale_rounds_up_where_mxfp8_saturates():
    # amax 500: w = fl(500 * fl(1/448)) = 1.116, byte 128 (scale 2): 500 / 2 = 250 rounds to
    # 256 (E4M3's step 16 in [128, 256)), back as 512; 13 / 2 = 6.5 is exact. OCP MX's floor
    # takes 2^(8 - 8) = 1, where 500 saturates to 448. A floor of w (byte 127) does too.
    x = _row([500.0, 13.0])
    assert _qdq(NAME, x)[:2].tolist() == [512.0, 13.0]
    assert formats.get("mxfp8").qdq(x)[0, 0] == 448.0


def test_an_amax_at_448_times_a_power_of_two_keeps_that_scale():
    # fl(1/448) rounds up, yet fl(448 * fl(1/448)) is exactly 1: byte 127, 448 exact; one
    # ulp above 448 the product is above 1 and the scale is 2 (3 * 2^-9 / 2 is a tie that
    # rounds to 2^-8, back as 2^-7).
    assert _qdq(NAME, _row([448.0, 3 * 2.0**-9]))[:2].tolist() == [448.0, 3 * 2.0**-9]
    above = float(np.nextafter(F32(448), F32(512)))
    assert _qdq(NAME, _row([above, 3 * 2.0**-9]))[1] == 2.0**-7


def test_no_finite_amax_of_a_binade_needs_the_saturation():
    # Every FP32 amax in [448, 896) (one binade stands for all: the rule scales by powers of
    # two): amax / 2^(byte - 127) is at most 448, with the byte from the bits of
    # fl(amax * fl(1/448)); the reference keeps the sampled ones at the oracle's bits.
    a = np.arange(0x43E00000, 0x44600000, dtype=np.uint32).view(F32)
    bits = (a * fmt_oracle.recip32(448.0)).astype(F32).view(np.uint32)
    byte = (bits >> 23).astype(np.int64) + ((bits & 0x7FFFFF) != 0)
    assert (a.astype(np.float64) / np.ldexp(1.0, byte - 127)).max() == 448.0
    sample = torch.from_numpy(np.concatenate([a[:512], a[::4099], a[-512:]]))
    x = torch.zeros(sample.numel(), 32)
    x[:, 0] = sample
    fmt_oracle.assert_bits_equal(formats.get(NAME).qdq(x), fmt_oracle.expected(NAME, x), NAME)


def test_a_subnormal_scale_product_keeps_the_block_where_te_mxfp8_flushes_it():
    # amax 2^-120: w = 2^-120 * fl(1/448) is an FP32 subnormal (<= 2^-127): the source's byte
    # is its exponent field 0 plus one (mantissa non-zero): 1, scale 2^-126, and the block
    # comes back exactly. TE's cvt.rp rounds w to byte 0 and quantizes with 1: zeros.
    values = [2.0**-120, -(2.0**-121), 3 * 2.0**-125]
    assert _qdq(NAME, _row(values))[:3].tolist() == values
    assert (formats.get("te_mxfp8").qdq(_row(values))[0, :3] == 0).all()


@pytest.mark.parametrize("values", [[-0.0, 0.0, 0.0, -0.0], [-(2.0**-149), 0.0, 2.0**-149, -0.0]],
                         ids=["zero-block", "underflowing-amax"])
def test_byte_zero_blocks_come_back_as_zeros_with_their_signs(values):
    # amax 0, or so small that amax * fl(1/448) underflows to 0: byte 0, decoded with the
    # float +0.0; each element keeps its sign (OCP E4M3 has -0).
    out = _qdq(NAME, _row(values))[:4]
    assert (out == 0).all()
    assert torch.signbit(out).tolist() == [v < 0 or str(v) == "-0.0" for v in values]


def test_the_element_is_ocp_e4m3_not_fnuz():
    # Scale 1 (amax 448). OCP E4M3 holds 448 (FNUZ saturates at 240); its subnormal step is
    # 2^-9, so 3 * 2^-10 is a tie that goes to 2^-8 (FNUZ, step 2^-10, holds it); -2^-12
    # rounds to -0.0 (FNUZ has no -0).
    out = _qdq(NAME, _row([448.0, 3 * 2.0**-10, -(2.0**-12)]))
    assert out[:3].tolist() == [448.0, 2.0**-8, 0.0] and torch.signbit(out[2])
    fnuz = fmt_oracle.e4m3fnuz(np.array([448.0, 3 * 2.0**-10, -(2.0**-12)]))
    assert fnuz.tolist() == [240.0, 3 * 2.0**-10, 0.0] and not np.signbit(fnuz[2])


def test_a_nonfinite_block_is_nan_and_the_other_blocks_untouched():
    x = _row([1.0, float("inf"), 2.0], hidden=64)
    x[0, 40] = 5.0
    out = formats.get(NAME).qdq(x)[0]
    assert torch.isnan(out[:32]).all()
    assert out[32:].tolist() == x[0, 32:].tolist()


# -- the transport: weighting before the cast, the FP32 top-k sum ------------------------------


def _transport_oracle(acc: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """NumPy: fl32(acc * w) per slot, the format's oracle, an FP32 sum from +0.0 in slot
    order, ml_dtypes' BF16 rounding; BF16 bits as int16."""
    rows = (acc * weights[..., None]).astype(F32)
    total = np.zeros(acc.shape[::2], dtype=F32)
    for s in range(acc.shape[1]):
        total = (total + fmt_oracle.ORACLES[NAME](rows[:, s])).astype(F32)
    return total.astype(ml_dtypes.bfloat16).view(np.int16)


def _as_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.copy()).view(torch.bfloat16)


def test_the_router_weight_is_applied_before_the_cast():
    # acc [500, 13], weight 0.75: the kernel casts [375, 9.75] (scale 1): 9.75 -> 10. Casting
    # first ([512, 13], scale 2) and weighting after gives 9.75.
    acc = _row([500.0, 13.0]).reshape(1, 1, 32)
    w = torch.tensor([[0.75]])
    y = flydsl.transport(acc, w)
    assert y[0, :2].tolist() == [384.0, 10.0]
    assert formats.get(NAME).dequantize(acc[0])[0, 1] * 0.75 == 9.75
    assert_same_bits(y, _as_bf16(_transport_oracle(acc.numpy(), w.numpy())), seed=None,
                     what="transport")


def test_the_kernel_casts_the_fp32_product_not_a_bf16_staging_of_it():
    # fl(acc * w) = 448 * (1 + 2^-20) has scale 2 (3 * 2^-9 -> 2^-7); the same row rounded to
    # BF16 first is 448, scale 1, where 3 * 2^-9 is exact.
    acc = _row([448.0 * (1 + 2.0**-20), 3 * 2.0**-9]).reshape(1, 1, 32)
    y = flydsl.transport(acc, torch.ones(1, 1))
    assert y[0, 1] == 2.0**-7
    assert formats.get(NAME).qdq(acc[0].to(torch.bfloat16))[0, 1] == 3 * 2.0**-9


def test_the_slots_add_in_ascending_order_from_zero_in_fp32():
    # Slot rows 2^24, 1, -2^24 (each exact): 2^24 + 1 rounds to 2^24 in FP32 (tie to even),
    # so the ascending sum is 0; the descending one would be 1.
    acc = torch.zeros(1, 3, 32)
    acc[0, :, 0] = torch.tensor([2.0**24, 1.0, -(2.0**24)])
    assert flydsl.transport(acc, torch.ones(1, 3))[0, 0] == 0.0
    assert flydsl.transport(acc.flip(1), torch.ones(1, 3))[0, 0] == 1.0


def _random_acc(seed: int, tokens: int = 5, k: int = 6, hidden: int = 256):
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(tokens, k, hidden, generator=g)
    # Blocks over many binades, so that the weighted amax crosses powers of two.
    acc = acc * torch.exp2(torch.randint(-30, 30, (tokens, k, hidden // 32, 1), generator=g)
                           .float()).repeat_interleave(32, dim=2).reshape(acc.shape)
    weights = torch.rand(tokens, k, generator=g)
    return acc, weights


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transport_matches_the_oracle_on_random_tokens(seed):
    seed = seed_of("flydsl-transport", seed)
    acc, weights = _random_acc(seed)
    assert_same_bits(flydsl.transport(acc, weights),
                     _as_bf16(_transport_oracle(acc.numpy(), weights.numpy())), seed=seed,
                     what="transport")


def test_resum_of_the_dequantized_weighted_rows_is_the_transport():
    """The table's ``fp32`` accumulation is this kernel's sum: moewire's re-sum of the FP32
    dequantized router-weighted rows (no further weighting) gives the transport's bits."""
    seed = seed_of("flydsl-resum")
    acc, weights = _random_acc(seed)
    rows = formats.get(NAME).dequantize(acc * weights.unsqueeze(-1)).transpose(0, 1)
    topk_idx = torch.zeros(acc.shape[:2], dtype=torch.int64)
    assert_same_bits(resum(rows.contiguous(), topk_idx, acc.shape[0]),
                     flydsl.transport(acc, weights), seed=seed, what="resum vs transport")


@pytest.mark.parametrize(
    "acc,weights,match",
    [
        (torch.zeros(2, 3, 32, dtype=torch.bfloat16), torch.ones(2, 3), "must be float32"),
        (torch.zeros(2, 3, 32), torch.ones(2, 3, dtype=torch.float64), "must be float32"),
        (torch.zeros(2, 3, 32), torch.ones(2, 4), r"acc must be \[T, k, H\]"),
        (torch.zeros(6, 32), torch.ones(2, 3), r"acc must be \[T, k, H\]"),
    ],
    ids=["bf16-acc", "fp64-weights", "weights-shape", "acc-2d"],
)
def test_transport_refuses(acc, weights, match):
    with pytest.raises(ValueError, match=match):
        flydsl.transport(acc, weights)


def test_moewire_formats_lists_it(capsys):
    assert cli.main(["formats", "--hidden", "7168"]) == 0
    line = next(r for r in capsys.readouterr().out.splitlines() if NAME in r)
    assert "8.25" in line
