"""NVFP4's FP32 global scale at a subnormal amax: ``fl(amax * fl(1/2688))`` underflows to 0
for a positive amax up to 1343 * 2^-149, and takes ModelOpt's 1e-12 there as for amax = 0
(``nvfp4`` with a static amax, ``nvfp4_token`` with an FP32 row's own max). A zero global
scale made every all-zero block NaN (``0 / (6 * 0)``).

The references against a float64 oracle of the documented math, and the Triton kernels
against the references: under Triton's interpreter where there is no GPU, compiled on CUDA
(marked ``gpu``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitexact import assert_same_bits
from moewire import formats
from moewire.formats.nvfp4 import nvfp4_global_scale

F32 = np.float32
_RECIP_2688 = F32(1.0) / F32(2688.0)


def _underflow_edge() -> tuple[float, float]:
    """The largest positive FP32 amax whose FP32 product ``amax * fl(1/2688)`` is 0, and the
    next FP32 value (the smallest whose product is positive), by a bisection over the bit
    patterns of the positive subnormals and the FP32 product itself."""
    lo, hi = 1, 1 << 23  # the product of bit pattern lo is 0; that of hi is not
    assert F32(np.uint32(lo).view(F32)) * _RECIP_2688 == 0
    assert np.uint32(hi).view(F32) * _RECIP_2688 > 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if np.uint32(mid).view(F32) * _RECIP_2688 == 0:
            lo = mid
        else:
            hi = mid
    return float(np.uint32(lo).view(F32)), float(np.uint32(hi).view(F32))


LAST_UNDER, FIRST_OVER = _underflow_edge()
# 1e-45 is the smallest subnormal, 2^-149; 3e-42 is above the edge (its product rounds to
# 2^-149 or more).
AMAXES = {"1e-45": 1e-45, "3e-42": 3e-42, "last_underflow": LAST_UNDER,
          "first_positive": FIRST_OVER}


def _oracle_gs(amax: float) -> float:
    """The global scale from the exact product in float64, rounded once to FP32 (the
    product of two 24-bit significands is exact in float64)."""
    gs = F32(np.float64(F32(amax)) * np.float64(_RECIP_2688))
    return float(gs) if gs > 0 else float(F32(1e-12))


def _e2m1(a: np.ndarray) -> np.ndarray:
    """E2M1 magnitude by the documented thresholds (RNE, saturating at 6)."""
    conds = [a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0]
    return np.select(conds, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0], 6.0)


def _oracle(x: torch.Tensor, gs_rows: np.ndarray) -> torch.Tensor:
    """NVFP4 of FP32 ``x`` [R, H] with FP32 global scales ``gs_rows`` [R], in float64 with
    one FP32 rounding where the documented math has one."""
    import ml_dtypes

    xb = x.numpy().astype(np.float64).reshape(x.shape[0], -1, 16)
    gs = gs_rows.astype(np.float64)[:, None, None]
    bmax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # a quotient above FP32's max rounds to inf, as in FP32
        t = np.minimum(F32(bmax / np.float64(F32(6.0 * gs))), F32(448.0))
    bs = F32(t.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * gs).astype(np.float64)
    bs = np.where(bs < F32(1e-5), 1.0, bs)
    q = _e2m1(F32(np.abs(xb) / bs).astype(np.float64))
    sign = np.where(xb > 0, 1.0, np.where(xb < 0, -1.0, 0.0))
    return torch.from_numpy(F32(sign * q * bs).reshape(x.shape))


def _static_rows(gen: torch.Generator) -> torch.Tensor:
    """FP32 [3, 64]: fresh normal values, block 1 all zero, block 2 subnormal values."""
    x = torch.randn(3, 64, generator=gen) * 3
    x[:, 16:32] = 0.0
    x[:, 32:48] = torch.randn(3, 16, generator=gen) * 1e-42
    return x


def _token_rows(gen: torch.Generator) -> torch.Tensor:
    """FP32 [4, 64]: a row per amax in :data:`AMAXES`, its max exactly that amax (values
    ``u * amax``, one element ``-amax``), block 1 of each all zero."""
    rows = []
    for a in AMAXES.values():
        row = (torch.rand(64, generator=gen) * 2 - 1) * a
        row[37] = -a
        row[16:32] = 0.0
        rows.append(row)
    return torch.stack(rows)


def test_the_underflow_edge_is_where_the_product_rounds_to_zero():
    """1343 * 2^-149: the exact product is just below 2^-150, half the smallest subnormal."""
    assert LAST_UNDER == 1343 * 2.0**-149 and FIRST_OVER == 1344 * 2.0**-149
    assert F32(LAST_UNDER) * _RECIP_2688 == 0 and F32(FIRST_OVER) * _RECIP_2688 == 2.0**-149


@pytest.mark.parametrize(
    "amax,keep_nan,want",
    [
        (0.0, False, 1e-12), (-1.0, False, 1e-12), (float("nan"), False, 1e-12),
        (float("nan"), True, float("nan")), (float("inf"), True, float("inf")),
        (1e-45, False, 1e-12), (1e-45, True, 1e-12), (LAST_UNDER, True, 1e-12),
        (FIRST_OVER, False, 2.0**-149), (FIRST_OVER, True, 2.0**-149),
        (3e-42, False, _oracle_gs(3e-42)), (2688.0, False, 1.0),
    ],
    ids=["zero", "negative", "nan", "nan_kept", "inf_kept", "min_subnormal",
         "min_subnormal_token", "last_underflow", "first_positive", "first_positive_token",
         "3e-42", "2688"],
)
def test_global_scale_falls_back_only_where_the_product_is_not_positive(amax, keep_nan, want):
    gs = nvfp4_global_scale(torch.tensor(amax, dtype=torch.float32), keep_nan=keep_nan)
    assert_same_bits(gs, torch.tensor(want, dtype=torch.float32), seed=None,
                     what=f"gs of amax={amax!r}")


@pytest.mark.parametrize("amax", AMAXES.values(), ids=AMAXES.keys())
def test_nvfp4_static_subnormal_amax_matches_the_oracle(amax):
    x = _static_rows(torch.Generator().manual_seed(11))
    out = formats.get("nvfp4").reference(x, torch.tensor(amax, dtype=torch.float32))
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 16:32], torch.zeros(3, 16))
    want = _oracle(x, np.full(3, _oracle_gs(amax), dtype=F32))
    assert_same_bits(out, want, seed=11, what=f"nvfp4 amax={amax!r}")
    assert torch.equal(formats.get("nvfp4").qdq(x, amax, use_kernel=False), out)


def test_nvfp4_token_subnormal_row_max_matches_the_oracle():
    x = _token_rows(torch.Generator().manual_seed(12))
    assert [float(r.abs().max()) for r in x] == [float(F32(a)) for a in AMAXES.values()]
    out = formats.get("nvfp4_token").reference(x, None)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 16:32], torch.zeros(len(AMAXES), 16))
    want = _oracle(x, np.array([_oracle_gs(a) for a in AMAXES.values()], dtype=F32))
    assert_same_bits(out, want, seed=12, what="nvfp4_token subnormal row maxima")


def test_nvfp4_token_special_rows_keep_their_documented_results():
    """A NaN row stays all NaN, a zero row zero, beside a subnormal row and a normal one."""
    x = torch.zeros(4, 32)
    x[0, 3] = float("nan")
    x[2, 5], x[2, 20] = 1e-45, -1e-45
    x[3] = torch.randn(32, generator=torch.Generator().manual_seed(13))
    out = formats.get("nvfp4_token").reference(x, None)
    assert torch.isnan(out[0]).all()
    assert torch.equal(out[1], torch.zeros(32)) and torch.isfinite(out[2:]).all()
    want = _oracle(x[2:], np.array([1e-12, _oracle_gs(float(x[3].abs().max()))], dtype=F32))
    assert_same_bits(out[2:], want, seed=13, what="nvfp4_token beside a NaN row")


# -- the Triton kernels, against the references ---------------------------------------------

pytest.importorskip("triton")

from tests.kernels.cases import DEVICES, combine_case, reference_combine  # noqa: E402

from moewire import kernels  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amax", AMAXES.values(), ids=AMAXES.keys())
def test_kernel_nvfp4_static_subnormal_amax(amax, device):
    x = _static_rows(torch.Generator().manual_seed(11)).to(device)
    a = torch.tensor(amax, dtype=torch.float32, device=device)
    got = kernels.qdq(x, "nvfp4", a)
    assert torch.isfinite(got).all()
    assert_same_bits(got, formats.get("nvfp4").reference(x, a), seed=11,
                     what=f"kernel nvfp4 amax={amax!r}")


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_nvfp4_token_subnormal_row_max(device):
    x = _token_rows(torch.Generator().manual_seed(12)).to(device)
    got = kernels.qdq(x, "nvfp4_token", None)
    assert torch.isfinite(got).all()
    assert_same_bits(got, formats.get("nvfp4_token").reference(x, None), seed=12,
                     what="kernel nvfp4_token subnormal row maxima")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amax", [1e-45, LAST_UNDER], ids=["1e-45", "last_underflow"])
def test_kernel_nvfp4_combine_subnormal_amax(amax, device):
    """The fused combine's per-tensor constant: BF16 rows with all-zero blocks."""
    gen = torch.Generator().manual_seed(14)
    rows, idx, _ = combine_case("nvfp4", k=3, tmax=6, num_tokens=4, hidden=128,
                                shared_slot=None, gen=gen, device=device)
    rows[:, :4, 16:48] = 0.0
    a = torch.tensor(amax, dtype=torch.float32, device=device)
    want = reference_combine(rows, idx, 4, "nvfp4", a, None)
    assert torch.isfinite(want).all()
    out = torch.full((4, 128), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.fused_combine(rows, idx, 4, out, "nvfp4", a, None, block_h=128)
    assert_same_bits(out, want, seed=14, what=f"combine nvfp4 amax={amax!r}")
