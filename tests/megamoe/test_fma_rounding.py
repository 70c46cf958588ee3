"""The weighted combine's single FP32 rounding per slot, in the torch paths.

The NVFP4 Mega-MoE combine is ``acc = fma(float(row), w, acc)``, one FP32 rounding per
slot, then one BF16 rounding (vLLM 0.34.0's `nvfp4_mega_moe`).
Two torch functions emulate the FMA: the re-sum's
``moewire.megamoe.resum._fma_f32`` and the NVFP4 reference kernel's
``moewire.reference.nvfp4._numerics.fma_f32`` (float64 product and sum, then round-to-odd
from the exact error, then FP32). Here they meet crafted cases (``tests/rounding_cases.py``)
where every plausible wrong rounding gives other bits, against an exact-rational oracle;
and ``resum(weights=)`` meets combine tokens where one FP32 rounding shows in BF16.
The Triton kernel's copy of the rule is tested in ``tests/kernels/test_weighted_rounding.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import rounding_cases as rc
from bitexact import assert_same_bits, seed_of
from moewire.megamoe.resum import _fma_f32, resum
from moewire.reference.nvfp4 import _numerics as nvfp4_numerics
from moewire.reference.nvfp4.mega_moe import weighted_combine

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
EMULATIONS = {
    "resum": _fma_f32,
    "reference": nvfp4_numerics.fma_f32,
}


def _tensors(cases, device="cpu"):
    a, b, c = (torch.tensor([case[i] for case in cases], dtype=torch.float32, device=device)
               for i in range(3))
    for i, case in enumerate(cases):  # every input is exactly the FP32 value written
        assert (float(a[i]), float(b[i]), float(c[i])) == tuple(case[:3]), case
    return a, b, c


def _want(cases) -> torch.Tensor:
    return torch.tensor([rc.fma_oracle(*case[:3]) for case in cases], dtype=torch.float32)


def _assert_cases(got: torch.Tensor, cases, what: str) -> None:
    """Bit for bit against the oracle; a failure lists the cases by their description."""
    want = _want(cases)
    bad = (got.cpu().view(torch.int32) != want.view(torch.int32)).nonzero().flatten().tolist()
    lines = [f"  {cases[i][3] if len(cases[i]) > 3 else cases[i][:3]}: got "
             f"{float(got[i])!r}, want {float(want[i])!r}" for i in bad[:8]]
    assert not bad, f"{what}: {len(bad)} of {len(cases)} cases differ:\n" + "\n".join(lines)


def test_the_oracle_rounds_like_ieee():
    """:func:`rc.round_to_f32` (exact rationals, own RNE) equals NumPy's correctly rounded
    float64 -> float32 conversion on float64 values at and next to FP32 ties, subnormals
    and the overflow edge: the oracle the FMA tests trust is itself right."""
    rng = np.random.default_rng(seed_of("oracle-rne"))
    sig = rng.integers(2**23, 2**24, 4000)
    exp = rng.integers(-160, 128, 4000)
    tie = np.ldexp(sig.astype(np.float64) + 0.5, exp - 23)  # FP32 ties (and below 2^-149)
    nudge = np.ldexp(1.0, exp - 23 - 40) * rng.choice([-1.0, 0.0, 1.0], 4000)
    values = np.concatenate([tie + nudge, -tie, [rc.F32_MAX + 2.0**103, 2.0**-150, 2.0**-151]])
    values = values[np.isfinite(values)]
    with np.errstate(over="ignore"):
        want = values.astype(np.float32)
    got = np.array([rc.round_to_f32(Fraction(float(v))) for v in values], dtype=np.float32)
    assert (got.view(np.uint32) == want.view(np.uint32)).all()
    assert rc.round_to_f32(Fraction(-1, 2**160)) == 0.0
    assert math.copysign(1.0, rc.round_to_f32(Fraction(0), negative_zero=True)) < 0


def test_the_cases_see_each_wrong_rounding():
    """The crafted cases separate the single rounding from: the float64 sum rounded to
    nearest then to FP32 (no round-to-odd), the product rounded to FP32 first, an error
    term from Fast2Sum (wrong when ``|a * b| > |c|``), and a round-to-odd step that also
    moves odd sums. (This proves the data; the emulations are checked below.)"""
    cases = rc.FMA_CASES
    a, b, c = _tensors(cases)
    want = _want(cases)
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    z = s - c64
    err = (c64 - (s - z)) + (p - z)
    inf = torch.full_like(s, math.inf)
    towards = torch.where(err > 0, inf, -inf)

    def moved(fix):
        return torch.where(fix & torch.isfinite(s), torch.nextafter(s, towards), s).float()

    wrong = {
        "round-to-nearest twice": s.float(),
        "product rounded first": ((a * b).double() + c64).float(),
        "odd sums moved too": moved(err != 0),
        "fast2sum error": torch.where(((p - z) != 0) & ((s.view(torch.int64) & 1) == 0)
                                      & torch.isfinite(s),
                                      torch.nextafter(s, torch.where(p - z > 0, inf, -inf)),
                                      s).float(),
    }
    for name, got in wrong.items():
        assert (got.view(torch.int32) != want.view(torch.int32)).any(), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("emulation", list(EMULATIONS))
def test_fma_emulation_on_crafted_cases(emulation, device):
    """Exact ties (both parities), float64 sums that round onto an FP32 tie, negatives,
    subnormal results, -0, large exponent gaps and the overflow edge, bit for bit.

    Catches (each verified by making the change): returning the float64 sum rounded to FP32
    without the round-to-odd step (``s.float()``: mutants ``*-fma-round-to-nearest``),
    moving an inexact sum away from the exact value (``torch.where(err > 0, -inf, inf)``),
    moving odd sums too (dropping the parity test), Fast2Sum's error term (``err = p - z``),
    and the product rounded to FP32 first (``p = (a * b).double()``).
    """
    if device == "cuda" and not CUDA:
        pytest.skip("needs CUDA")
    cases = rc.FMA_CASES
    got = EMULATIONS[emulation](*_tensors(cases, device))
    assert got.dtype == torch.float32
    _assert_cases(got, cases, f"{emulation} FMA on {device}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("emulation", list(EMULATIONS))
def test_fma_emulation_near_ties(emulation, device):
    """600 random ``(a, b, c)`` at an FP32 tie or less than 2^-28 ulp from one (random
    ``c`` over 200 binades, both signs, four kinds of product), bit for bit against the
    oracle. Catches the same changes as the crafted cases, on data nobody picked by hand."""
    if device == "cuda" and not CUDA:
        pytest.skip("needs CUDA")
    cases = rc.near_tie_cases(seed_of("near-ties", emulation))
    got = EMULATIONS[emulation](*_tensors(cases, device))
    _assert_cases(got, cases, f"{emulation} FMA near ties on {device}")


def _rows(routed, shared, position):
    if position is None:
        return routed.clone()
    return torch.cat([routed, shared[None]]).contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("position", rc.POSITIONS, ids=rc.POSITION_IDS)
def test_weighted_resum_rounds_once_per_slot(position, device):
    """``resum(weights=)`` on tokens where one FP32 rounding shows in BF16: its result is
    the oracle's and the hand-derived table's, and each wrong rounding of :data:`rc.WRONG`
    gives other bits on this data (asserted here, of the oracle).

    Catches (each verified by making the change in ``resum.py``): a multiply then an add
    (mutant ``resum-weighted-mul-then-add``), the float64 sum rounded to nearest before
    FP32 (``resum-fma-round-to-nearest``), a float64 accumulator across slots
    (``resum-fma-float64-accumulator``), a BF16 rounding after each weighted add, and the
    final rounding with ties away from zero.
    """
    if device == "cuda" and not CUDA:
        pytest.skip("needs CUDA")
    seed = seed_of("weighted-resum-rounding", position)
    routed, shared, idx, weights, t = rc.make_tokens(seed)
    rows = _rows(routed, shared, position)
    got = resum(rows.to(device), idx.to(device), t, shared_position=position,
                weights=weights.to(device))
    args = (routed.float().numpy(), shared.float().numpy(), idx.numpy(), weights.numpy(), t)
    want = rc.weighted_oracle(*args, position)
    assert_same_bits(got, want, seed=seed, what=f"weighted resum, shared {position}")
    n = len(rc.TOKENS)
    for col in rc.CRAFTED:
        assert_same_bits(got[:n, col], rc.expected_crafted(position), seed=seed,
                         what=f"weighted resum at crafted column {col}, shared {position}")
    for wrong in rc.WRONG:
        other = rc.weighted_oracle(*args, position, wrong=wrong)
        assert (other[:n][:, list(rc.CRAFTED)] != want[:n][:, list(rc.CRAFTED)]).any(), (
            f"the tokens do not separate one rounding from {wrong}")


@pytest.mark.parametrize("position", [None, "last"], ids=["no-shared", "shared-last"])
def test_nvfp4_reference_kernel_combine_rounds_once_per_slot(position):
    """The NVFP4 reference kernel's own combine (``reference.nvfp4.mega_moe.
    weighted_combine``, the stand-in for the real kernel's ``__ffma2_rn`` loop; its shared
    row is always last) on the same tokens: the oracle's bits and the table's.

    Catches (verified by making the change): its FMA as a multiply then an add (mutant
    ``reference-combine-multiply-then-add``), and its ``fma_f32`` without round-to-odd.
    """
    seed = seed_of("reference-weighted-combine", position)
    routed, shared, idx, weights, t = rc.make_tokens(seed)
    got = weighted_combine(_rows(routed, shared, position), idx[:t], weights[:t], t,
                           position == "last")
    args = (routed.float().numpy(), shared.float().numpy(), idx.numpy(), weights.numpy(), t)
    assert_same_bits(got, rc.weighted_oracle(*args, position), seed=seed,
                     what=f"reference weighted_combine, shared {position}")
    for col in rc.CRAFTED:
        assert_same_bits(got[: len(rc.TOKENS), col], rc.expected_crafted(position), seed=seed,
                         what=f"reference weighted_combine at column {col}")
