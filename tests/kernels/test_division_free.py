"""The NVFP4 quotient without a per-element division, against FP32 division.

``_triton._div_by_block`` computes ``fl(a / b)`` from one reciprocal per block and two
FMAs (Markstein's correction); ``_triton._fma`` is one FP32 rounding on the GPU and,
emulated in FP64 with round-to-odd, under the interpreter. The oracles here are
independent: ``torch``'s FP32 division (IEEE, correctly rounded) and exact rational
arithmetic (``fractions``) for the FMA.

The data is adversarial: ``a`` is the BF16 value nearest ``m * b`` (and its neighbours) for
every E2M1 grid point and rounding midpoint ``m``, with block scales ``b`` drawn as NVFP4
makes them (an E4M3 value times an FP32 global scale); there ``fl(a * fl(1/b))`` alone is
often one ulp off, and one ulp decides a tie.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from bitexact import assert_same_bits, seed_of

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moewire.kernels import _triton  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# Compiled with the GPU's own FMA and casts where there is one, else under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HW = DEVICE == "cuda"

POINTS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


def _adversarial(n_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    e4m3 = (torch.rand(n_blocks, 1, generator=gen) * 448).to(torch.float8_e4m3fn).float()
    e4m3 = torch.where(e4m3 == 0, torch.ones_like(e4m3), e4m3)
    gs = torch.exp(torch.empty(n_blocks, 1).uniform_(-25.0, 60.0, generator=gen))
    b = e4m3 * gs
    b = torch.where(b < 1e-5, torch.ones_like(b), b)
    m = torch.tensor(POINTS)[torch.randint(0, len(POINTS), (n_blocks, 16), generator=gen)]
    a = (m.double() * b.double()).float().to(torch.bfloat16)
    # Neighbours of the nearest BF16 value: the quotient straddles the point.
    step = torch.randint(-2, 3, (n_blocks, 16), generator=gen).to(torch.int16)
    a = (a.view(torch.int16) + step).view(torch.bfloat16).float().abs()
    return a, b


@triton.jit
def _div_kernel(a_ptr, b_ptr, out_ptr, NB: tl.constexpr, HW_CAST: tl.constexpr):
    blocks = tl.arange(0, NB)[:, None]
    cols = tl.arange(0, 16)[None, :]
    a = tl.load(a_ptr + blocks * 16 + cols)
    b = tl.load(b_ptr + blocks)
    tl.store(out_ptr + blocks * 16 + cols, _triton._div_by_block(a, b, HW_CAST, False))


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr, HW_CAST: tl.constexpr):
    i = tl.arange(0, N)
    out = _triton._fma(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), HW_CAST)
    tl.store(out_ptr + i, out)


@pytest.mark.parametrize("seed", [seed_of("div-free", s) for s in range(3)])
def test_div_by_block_equals_fp32_division(seed):
    a, b = _adversarial(1024, seed)
    a[0, :4] = torch.tensor([0.0, float("inf"), float("nan"), 1e-40])
    b[1] = float("inf")
    out = torch.empty_like(a, device=DEVICE)
    _div_kernel[(1,)](a.to(DEVICE), b.reshape(-1).contiguous().to(DEVICE), out, NB=1024,
                      HW_CAST=HW, enable_fp_fusion=False)
    out = out.cpu()
    want = a / b
    # A subnormal quotient (below 2^-126) may be an ulp off (Markstein's theorem assumes no
    # underflow); E2M1 maps every quotient below 0.25 to 0, so NVFP4 never sees it.
    tiny = (want != 0) & (want.abs() < 2.0**-126)
    assert tiny.sum() <= 1 and bool((out[tiny].abs() < 0.25).all())
    assert_same_bits(
        torch.where(tiny, want, out), want, seed=seed, what="div_by_block vs FP32 division"
    )


def test_the_data_needs_the_correction():
    """Without Markstein's step, ``fl(a * fl(1/b))`` differs from the quotient here."""
    a, b = _adversarial(1024, seed_of("div-free", 0))
    approx = a * (1.0 / b)
    assert (approx != a / b).sum() > 0


def _exact_fma32(a: float, b: float, c: float) -> float:
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    lo = np.float32(float(exact))  # nearest double, then nearest FP32: fix the tie below
    cands = [lo, np.nextafter(lo, np.float32(-np.inf)), np.nextafter(lo, np.float32(np.inf))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                     int(np.array(v).view(np.int32)) & 1))
    return float(best)


def test_fma_emulation_rounds_once():
    gen = torch.Generator().manual_seed(seed_of("fma-emulation"))
    n = 256
    a = torch.randn(n, generator=gen)
    b = torch.randn(n, generator=gen)
    # c cancels most of a * b: the exact FMA keeps the low bits a multiply-then-add loses.
    c = -(a.double() * b.double()).float() + torch.randn(n, generator=gen) * 1e-6
    a[0], b[0], c[0] = 0.003936767578125, 0.9922632575035095, 1.0
    out = torch.empty(n, device=DEVICE)
    _fma_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), out, N=n, HW_CAST=HW,
                      enable_fp_fusion=False)
    out = out.cpu()
    want = torch.tensor([_exact_fma32(float(x), float(y), float(z)) for x, y, z in
                         zip(a, b, c, strict=True)])
    assert_same_bits(out, want, seed=None, what="interpreter _fma vs exact FMA")
    assert (out != a * b + c).any(), "the data does not separate one rounding from two"
