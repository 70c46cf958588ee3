"""Data where one FP32 rounding shows: the weighted combine's FMA.

The NVFP4 Mega-MoE combine is ``acc = fma(float(row), w, acc)`` with ONE FP32 rounding per
slot, then one BF16 rounding (vLLM 0.34.0's `nvfp4_mega_moe`). moewire emulates the FMA in torch
(``moewire.megamoe.resum._fma_f32``, ``moewire.reference.nvfp4._numerics.fma_f32``) and in
the Triton interpreter (``moewire.kernels._triton._fma``): the float64 product is exact, the
float64 sum is made round-to-odd from its exact error (TwoSum), then rounded to FP32. On
random data a wrong rounding rarely changes a BF16 result, so these cases are crafted:

- :data:`FMA_CASES`: ``(a, b, c)`` whose exact ``a * b + c`` sits at a tie between two
  FP32 values, or less than 2^-28 of an FP32 ulp from one: both parities, both signs,
  subnormal, near overflow, with large exponent gaps. The oracle is :func:`fma_oracle`:
  exact rationals (``fractions.Fraction``) rounded to FP32 by :func:`round_to_f32`, this
  module's own round-to-nearest-even (no float arithmetic on the way).
- :data:`TOKENS`: combine tokens (BF16 rows, FP32 weights, a fused shared row) whose BF16
  result changes under each plausible wrong rounding (:data:`WRONG`), checked by the
  oracle :func:`weighted_oracle` that can also compute those wrong roundings.

Why ``2^30 +- 1``: the float64 sum ``c + a * b`` loses the bits of ``a * b`` more than 52
places below ``c``'s leading bit. For the round-to-odd step to matter, the exact sum must
be an FP32 tie plus or minus such a lost bit; ``a * b = (2^30 +- 1) * 2^-54`` puts the tie
bit at 2^-24 and the lost bit at 2^-54 (next to ``c`` near 1). With a BF16 row (8
significant bits) and an FP32 weight (24), the factors are 65 * 16519105 = 2^30 + 1 and
77 * 13944699 = 2^30 - 1.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np

F32_MAX = float(np.finfo(np.float32).max)
TWO = Fraction(2)


def is_f32(x: float) -> bool:
    """True when the Python float ``x`` is exactly an FP32 value (or inf/NaN)."""
    return math.isnan(x) or float(np.float32(x)) == x


def round_to_f32(x: Fraction, negative_zero: bool = False) -> float:
    """The FP32 value nearest the exact rational ``x``, ties to even (IEEE RNE).

    Subnormals keep the fixed quantum 2^-149; a magnitude that rounds to 2^128 or more
    overflows to infinity. ``negative_zero``: the sign of an exact zero (IEEE: -0 only when
    both addends are -0, or a negative value rounds to zero).

    Returns:
        A Python float holding the FP32 value exactly.
    """
    if x == 0:
        return -0.0 if negative_zero else 0.0
    sign = -1.0 if x < 0 else 1.0
    m = abs(x)
    e = m.numerator.bit_length() - m.denominator.bit_length()
    if TWO**e > m:
        e -= 1
    quantum = TWO ** (max(e, -126) - 23)
    n = m / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    value = whole * quantum
    if value >= TWO**128:
        return sign * math.inf
    return sign * float(value)  # exact: value has at most 24 significant bits


def fma_oracle(a: float, b: float, c: float) -> float:
    """``fl32(a * b + c)`` with one rounding, from exact rationals (finite FP32 inputs)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    product_negative = (math.copysign(1.0, a) * math.copysign(1.0, b)) < 0
    both_negative_zero = exact == 0 and product_negative and math.copysign(1.0, c) < 0
    return round_to_f32(exact, negative_zero=both_negative_zero)


def _p(significand: int, exponent: int) -> float:
    return math.ldexp(significand, exponent)


# (a, b, c, why). Every value is FP32; the expected result is fma_oracle's (the comments
# give it for reading). "RN twice" is the float64 sum rounded to nearest, then to FP32.
_BASE_CASES = [
    # The product alone (c = 0) at an FP32 tie, both parities.
    (1 + 2**-12, 1 + 2**-12, 0.0, "product tie 1+2^-11+2^-24 -> even below (1+2^-11)"),
    (1 + 3 * 2**-12, 1 + 2**-12, 0.0, "product tie 1+2^-10+3*2^-24 -> even above"),
    # An exact float64 sum at an FP32 tie, both parities.
    (2**-12, 2**-12, 1.0, "sum tie 1+2^-24 -> 1"),
    (2**-12, 2**-12, 1 + 2**-23, "sum tie 1+3*2^-24 -> 1+2^-22"),
    # The float64 sum rounds onto an FP32 tie: only round-to-odd gives the right side.
    ((1 + 2**-12) * 2**-24, 1 - 2**-12 + 2**-24, 1.0,
     "exact 1+2^-24+2^-60 -> 1+2^-23; RN twice gives 1"),
    (-(1 + 2**-12) * 2**-24, 1 - 2**-12 + 2**-24, 1 + 2**-22,
     "exact 1+2^-23+2^-24-2^-60 -> 1+2^-23; RN twice gives 1+2^-22"),
    (-(1 + 2**-12) * 2**-24, 1 - 2**-12 + 2**-24, 2.0,
     "exact 2-2^-24-2^-60 (below a binade edge) -> 2-2^-23; RN twice gives 2"),
    (_p(65, -30), _p(16519105, -24), 1 + 2**-8,
     "BF16 row x FP32 weight: exact 1+2^-8+2^-24+2^-54 -> 1+2^-8+2^-23; RN twice 1+2^-8"),
    (_p(77, -30), _p(13944699, -24), 1 + 2**-7 + 2**-8 - 2**-23,
     "BF16 row x FP32 weight: exact odd + 2^-24 - 2^-54 -> the odd value; RN twice: up"),
    # The float64 sum is inexact by 27/32 of its ulp: it rounds to the odd neighbour of
    # an FP32 tie, which round-to-odd keeps (a correction of odd sums too would move it
    # onto the tie, and the tie then rounds to even, the wrong side).
    ((1 + 3 * 2**-11) * 2**-24, 1 - 3 * 2**-11 + 9 * 2**-22, 1.0,
     "exact 1+2^-24+27*2^-57 -> 1+2^-23; an odd sum moved onto the tie gives 1"),
    ((1 - 3 * 2**-11) * 2**-24, 1 + 3 * 2**-11 + 9 * 2**-22, 1 + 2**-23,
     "exact 1+3*2^-24-27*2^-57 -> 1+2^-23; an odd sum moved onto the tie: 1+2^-22"),
    # A large product and a tiny c (|p| >> |c|: Fast2Sum's error term would be wrong).
    (1 + 2**-12, 1 + 2**-12, 2**-60, "product tie + 2^-60 -> above the tie (1+2^-11+2^-23)"),
    (1 + 3 * 2**-12, 1 + 2**-12, -(2**-60), "odd-above product tie - 2^-60 -> below"),
    (2.0**50, 2.0**50, 2.0**-100, "2^100 + 2^-100 -> 2^100"),
    # A tiny product and a large c.
    (2.0**-40, -(2.0**-40), 1.0, "1 - 2^-80 -> 1"),
    (2.0**-40, -(2.0**-40), 1 + 2**-23, "1+2^-23 - 2^-80 -> 1+2^-23"),
    (2.0**-30, -(2.0**-30), 2.0, "2 - 2^-60 -> 2 (the float64 sum rounds up to 2)"),
    (1.0, 1.0, 2.0**100, "2^100 + 1 -> 2^100"),
    # Cancellation: the low product bits survive (no rounding of the product).
    (1 + 2**-23, 1 + 2**-23, -(1 + 2**-22), "(1+2^-23)^2 - (1+2^-22) = 2^-46 exactly"),
    (1 + 2**-23, 1 - 2**-23, -1.0, "-2^-46 exactly"),
    # Subnormal results.
    (2.0**-75, 2.0**-75, 0.0, "2^-150: tie between 0 and 2^-149 -> +0"),
    (1.5 * 2**-75, 2.0**-74, 0.0, "3*2^-150: tie -> 2^-148"),
    (2.0**-75, 2.0**-75, 2.0**-149, "2^-149 + 2^-150: tie -> 2^-148"),
    (2.0**-75, 2.0**-75, 3 * 2.0**-149, "3.5 * 2^-149: tie -> 4 * 2^-149"),
    (2.0**-75, 2.0**-74, _p(2**23 - 1, -149), "the largest subnormal + 2^-149 = 2^-126"),
    (1.25 * 2**-75, 2.0**-75, 0.0, "1.25 * 2^-150 -> 2^-149"),
    (2.0**-100, -(2.0**-60), 0.0, "-2^-160 rounds to -0"),
    ((1 + 2**-12) * 2**-75, (1 - 2**-12 + 2**-24) * 2**-75, 2.0**-149,
     "2^-149 + 2^-150 + 2^-186 -> 2^-148 (exactly 1.5 subnormal steps plus)"),
    # Near overflow: the float64 sum rounds onto the tie between FLT_MAX and 2^128.
    ((1 - 2**-18) * 2.0**51, (1 + 2**-18) * 2.0**52, F32_MAX,
     "FLT_MAX + 2^103 - 2^67 -> FLT_MAX; RN twice gives inf"),
    ((1 + 2**-12) * 2.0**51, (1 - 2**-12 + 2**-24) * 2.0**52, F32_MAX,
     "FLT_MAX + 2^103 + 2^67 -> inf"),
    (2.0**64, 2.0**64, 0.0, "2^128 -> inf"),
]


def _signed(cases):
    """Each case, and with the product and ``c`` negated (and the weight negated instead of
    the row): RNE is symmetric, so the result is negated too."""
    out = []
    for a, b, c, why in cases:
        out.append((a, b, c, why))
        out.append((-a, b, -c, "negated: " + why))
        out.append((a, -b, -c, "negated (b): " + why))
    return out


FMA_CASES = _signed(_BASE_CASES)
FMA_IDS = [f"{i}-{why.split(':')[0][:40]}" for i, (_, _, _, why) in enumerate(FMA_CASES)]


def near_tie_cases(seed: int, n: int = 600) -> list[tuple[float, float, float]]:
    """Random ``(a, b, c)`` whose exact ``a * b + c`` lies at an FP32 tie, or less than 2^-28
    of an FP32 ulp above or below one: ``c`` random (sign, 24-bit significand,
    exponent), ``a * b = ulp(c) / 2 * (1 + 2^-3k)`` or ``* (1 - 2^-2j)`` (exact products of
    two FP32 values: ``(1 + x)(1 - x + x^2) = 1 + x^3``, ``(1 + x)(1 - x) = 1 - x^2``), or
    exactly half an ulp, with either sign."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        sig = int(rng.integers(2**23, 2**24))
        exp = int(rng.integers(-100, 100))
        c = math.ldexp(sig, exp - 23) * (1 if rng.random() < 0.5 else -1)
        half_ulp = math.ldexp(1.0, exp - 24)
        kind = int(rng.integers(0, 4))
        if kind == 3:  # 1 +- 27 * 2^-33: 27/32 of the float64 ulp of c off the tie
            x = 3 * 2.0**-11 * (1 if rng.random() < 0.5 else -1)
            a, b = (1 + x) * half_ulp, 1 - x + x * x
        elif kind == 0:
            k = int(rng.integers(10, 13))
            a, b = (1 + 2.0**-k) * half_ulp, 1 - 2.0**-k + 2.0 ** (-2 * k)
        elif kind == 1:
            j = int(rng.integers(15, 24))
            a, b = (1 + 2.0**-j) * half_ulp, 1 - 2.0**-j
        else:
            a, b = half_ulp, 1.0
        if rng.random() < 0.5:
            a = -a
        cases.append((a, b, c))
    return cases


# -- combine tokens ------------------------------------------------------------------------

K = 4
S = 2.0**-6  # the fused shared row's value at the crafted columns (weight 1.0)
POSITIONS = (None, "first", "last")
POSITION_IDS = ["no-shared", "shared-first", "shared-last"]


def _bf16(x: float) -> float:
    assert float(np.float32(x).astype(ml_dtypes.bfloat16)) == x, f"{x} is not BF16"
    return x


# Per token: ((row, weight) per routed slot, None for an invalid slot), the shared row's
# sign (the shared value is sign * S), and y for shared position None / "first" / "last".
# Every FMA step but the named one is exact; S adds exactly wherever it goes.
_R65, _W65 = _bf16(_p(65, -30)), _p(16519105, -24)  # product (2^30 + 1) * 2^-54
_R77, _W77 = _bf16(_p(77, -30)), _p(13944699, -24)  # product (2^30 - 1) * 2^-54
_ODD = 1 + 2**-7 + 2**-8 - 2**-23  # an odd FP32 value just below a BF16 tie
TOKENS = [
    # fma(r, w, 1+2^-8) = 1+2^-8+2^-23 (exact: + 2^-24 + 2^-54, above the FP32 tie), BF16
    # above the tie at 1+2^-8. Rounded twice (float64 then FP32) it is the tie 1+2^-8 (even),
    # then BF16 1.0.
    (((1.0, 1 + 2**-8), (_R65, _W65), None, None), 1,
     (1 + 2**-7, 1 + 2**-6 + 2**-7, 1 + 2**-6 + 2**-7)),
    # fma(r, w, odd) = odd (exact: odd + 2^-24 - 2^-54, below the FP32 tie), BF16 below
    # the tie at 1+2^-7+2^-8. Rounded twice it is that BF16 tie, then 1+2^-6 (even).
    ((None, (1.0, _ODD), (_R77, _W77), None), 1,
     (1 + 2**-7, 1 + 2**-6 + 2**-7, 1 + 2**-6 + 2**-7)),
    # The same two, negated (rows and shared row).
    (((-1.0, 1 + 2**-8), (-_R65, _W65), None, None), -1,
     (-1 - 2**-7, -1 - 2**-6 - 2**-7, -1 - 2**-6 - 2**-7)),
    ((None, (-1.0, _ODD), None, (-_R77, _W77)), -1,
     (-1 - 2**-7, -1 - 2**-6 - 2**-7, -1 - 2**-6 - 2**-7)),
    # Exact FP32 sums: 1 + 2^-9 + 2^-10 (BF16 1.0 if rounded there) + 2^-9 + 2^-10 is
    # 1 + 2^-8 + 2^-9, above the BF16 tie: 1+2^-7. A BF16 rounding per add gives 1.0.
    (((1.0, 1 + 2**-9 + 2**-10), (1.0, 2**-9 + 2**-10), None, None), 1,
     (1 + 2**-7, 1 + 2**-6 + 2**-7, 1 + 2**-6 + 2**-7)),
    # Each FP32 step rounds 1+2^-8+2^-24 to the tie 1+2^-8 (even), which rounds to BF16 1.0;
    # an accumulator wider than FP32 keeps 1+2^-8+2^-23, BF16 1+2^-7.
    (((1.0, 1 + 2**-8), (_bf16(2**-24), 1.0), (_bf16(2**-24), 1.0), None), 1,
     (1.0, 1 + 2**-6, 1 + 2**-6)),
    # The FP32 sum exactly at a BF16 tie: ties to even going down, then up.
    (((1.0, 1.0), None, (_bf16(2**-7), 0.5), None), 1, (1.0, 1 + 2**-6, 1 + 2**-6)),
    (((1.0, 1 + 2**-7), (_bf16(2**-7), 0.5), None, None), 1,
     (1 + 2**-6, 1 + 2**-5, 1 + 2**-5)),
]
# Columns that hold the crafted values (one per 128-column block, the rest random).
CRAFTED = (3, 130)


def make_tokens(seed: int, hidden: int = 256, extra: int = 2):
    """Routed rows, shared rows, ids and weights for :data:`TOKENS` at :data:`CRAFTED`.

    Other columns hold random BF16 data (the same weights); ``extra`` more tokens are
    random, and the tokens past them are stale (NaN rows, ids -1).

    Returns:
        ``routed`` BF16 ``[K, Tmax, H]``, ``shared`` BF16 ``[Tmax, H]``, ``topk_idx``
        int64 ``[Tmax, K]``, ``weights`` FP32 ``[Tmax, K]``, ``t`` (tokens of the call).
    """
    import torch

    t = len(TOKENS) + extra
    tmax = t + 2
    g = torch.Generator().manual_seed(seed)
    routed = (torch.randn(K, tmax, hidden, generator=g) * 3).bfloat16()
    shared = (torch.randn(tmax, hidden, generator=g) * 3).bfloat16()
    topk_idx = torch.randint(0, 64, (tmax, K), generator=g)
    weights = (torch.rand((tmax, K), generator=g, dtype=torch.float64) * 0.9 + 0.05).float()
    crafted = [col for col in CRAFTED if col < hidden]
    for tok, (slots, shared_sign, _) in enumerate(TOKENS):
        for s, slot in enumerate(slots):
            if slot is None:
                topk_idx[tok, s] = -1
                routed[s, tok] = float("nan")
            else:
                routed[s, tok, crafted] = slot[0]
                weights[tok, s] = slot[1]
        shared[tok, crafted] = shared_sign * S
    topk_idx[t:] = -1
    routed[:, t:] = float("nan")
    shared[t:] = float("nan")
    return routed, shared, topk_idx, weights, t


def expected_crafted(position: str | None):
    """BF16 ``[len(TOKENS)]``: y at every crafted column, from the table (hand-derived)."""
    import torch

    col = POSITIONS.index(position)
    return torch.tensor([want[col] for _, _, want in TOKENS], dtype=torch.bfloat16)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _step(row: float, w: float, acc: float, wrong: str | None) -> float:
    """One weighted add, with one FP32 rounding (``wrong is None``) or a wrong rounding."""
    if wrong == "multiply-then-add":
        return round_to_f32(Fraction(round_to_f32(Fraction(row) * Fraction(w))) + Fraction(acc))
    if wrong == "round-twice":  # float64 sum (nearest), then FP32
        return float(np.float32(row * w + acc))  # row * w is exact in float64
    return fma_oracle(row, w, acc)


# Wrong roundings the tokens must each expose (for every shared position).
WRONG = ("multiply-then-add", "round-twice", "bf16-per-add", "float64-acc", "final-half-up")


def weighted_oracle(routed, shared, topk_idx, weights, t, position, wrong=None):
    """The NVFP4 kernel's combine (``wrong=None``) or one of :data:`WRONG`, per element.

    ``acc = +0``; ``acc = fma(row, w, acc)`` over the valid slots ascending, the shared row
    with weight 1.0 first or last; ``y = bf16(acc)`` (RNE). Wrong variants: the product
    rounded to FP32 before the add; the float64 sum rounded to nearest before FP32 (no
    round-to-odd); a BF16 rounding after each add; a float64 accumulator rounded once at
    the end (to FP32, then BF16); the final BF16 rounding with ties away from zero.

    Args:
        routed: float32 ``[K, Tmax, H]``; shared: float32 ``[Tmax, H]`` (or None);
        topk_idx: int ``[>= t, K]``; weights: float32 ``[>= t, K]``.

    Returns:
        uint16 BF16 bits ``[t, H]``.
    """
    k, hidden = routed.shape[0], routed.shape[2]
    out = np.zeros((t, hidden), dtype=np.float32)
    for tok in range(t):
        terms = [(routed[s, tok], float(weights[tok, s])) for s in range(k)
                 if topk_idx[tok, s] >= 0]
        if position == "first":
            terms.insert(0, (shared[tok], 1.0))
        elif position == "last":
            terms.append((shared[tok], 1.0))
        for col in range(hidden):
            acc = 0.0
            for row, w in terms:
                r = float(row[col])
                if wrong == "float64-acc":
                    acc = r * w + acc
                else:
                    acc = _step(r, w, acc, wrong)
                    if wrong == "bf16-per-add":
                        acc = float(_bf16_round(np.float32(acc)))
            out[tok, col] = np.float32(acc)
    if wrong == "final-half-up":
        bits = out.view(np.uint32).astype(np.uint64)
        return (((bits + 0x8000) >> 16) & 0xFFFF).astype(np.uint16)
    return out.astype(ml_dtypes.bfloat16).view(np.uint16)
