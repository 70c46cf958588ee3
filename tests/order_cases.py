"""Combine rows whose FP32 summation order survives the BF16 rounding.

Random rows (``randn * 3``) give the same BF16 sum in any order, so a test on them cannot
tell ascending from descending slots, the shared row first from last, or one rounding from
one per add. The tokens below can: at their crafted columns each order gives other bits.
``A + C == A`` in FP32 (``C`` is below half an ulp of ``A``), so ``(A - A) + C = C`` while
``(A + C) - A = 0``. Every value is a power of two (or ``1.25 * 2^-8``), exact in BF16 and
in every per-block format, so the order still shows after a row quantizer.

The independent oracle (:func:`oracle`) is a NumPy float32 loop over the terms of each
token; it can also sum in the wrong orders, which is how the tests prove their data
separates the orders.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

A = 2.0**20
C = 2.0**-6
D = 1.25 * 2.0**-8
K = 4
POSITIONS = (None, "first", "last")
POSITION_IDS = ["no-shared", "shared-first", "shared-last"]

# Per token: routed values of slots 0..3 (None: invalid slot, its row holds stale NaN), the
# shared row's value, and y for shared position None / "first" / "last".
TOKENS = [
    ((A, -A, C, 0.0), 0.0, (C, C, C)),  # ascending: C; descending: 0
    ((2.0**24, 2.0**16, 1.0, 1.0), 0.0, (2.0**24,) * 3),  # FP32 ascending; float64 rounds up
    ((1.0, D, D, 0.0), 0.0, (1.0 + 2.0**-7,) * 3),  # one rounding; one per add gives 1 + 2^-6
    ((A, None, -A, C), 0.0, (C, C, C)),  # the invalid slot is selected away, never added
    ((None, None, None, None), C, (0.0, C, C)),  # no routed slot: +0, or the shared row alone
    ((A, -A, 0.0, 0.0), C, (0.0, 0.0, C)),  # shared first: (C + A) - A = 0; last: C
    ((-A, C, 0.0, 0.0), A, (-A, C, 0.0)),  # shared first: (A - A) + C = C; last: 0
]
# Columns that hold the crafted values: one in each half of H = 2048, so with the fused
# kernel's default block (1024 columns) both programs of a token see one.
CRAFTED = (5, 1029)
# The crafted columns' 128-column blocks hold nothing else (a per-block scale then keeps
# each crafted value exact); every other column holds random data.
BLOCK = 128


def make_case(seed: int, hidden: int = 2048, tmax: int | None = None):
    """Routed rows, shared rows and ids for :data:`TOKENS` (crafted columns below ``hidden``).

    Returns:
        ``routed`` BF16 ``[K, Tmax, H]``, ``shared`` BF16 ``[Tmax, H]``, ``topk_idx`` int64
        ``[Tmax, K]`` (-1 for invalid slots) and ``t`` (``len(TOKENS)``). Tokens past ``t``
        and invalid slots hold NaN (stale rows).
    """
    t = len(TOKENS)
    tmax = tmax or t + 2
    g = torch.Generator().manual_seed(seed)
    routed = torch.randn(K, tmax, hidden, generator=g) * 3
    shared = torch.randn(tmax, hidden, generator=g) * 3
    topk_idx = torch.randint(0, 16, (tmax, K), generator=g)
    crafted = [col for col in CRAFTED if col < hidden]
    for col in crafted:
        lo = col // BLOCK * BLOCK
        routed[:, :t, lo : lo + BLOCK] = 0.0
        shared[:t, lo : lo + BLOCK] = 0.0
    for tok, (values, shared_value, _) in enumerate(TOKENS):
        for s, v in enumerate(values):
            if v is None:
                topk_idx[tok, s] = -1
                routed[s, tok] = float("nan")
            else:
                routed[s, tok, crafted] = v
        shared[tok, crafted] = shared_value
    topk_idx[t:] = -1
    routed[:, t:] = float("nan")
    shared[t:] = float("nan")
    return routed.bfloat16(), shared.bfloat16(), topk_idx, t


def expected_crafted(position: str | None) -> torch.Tensor:
    """BF16 ``[len(TOKENS)]``: y at every crafted column, from the table (hand-derived)."""
    col = POSITIONS.index(position)
    return torch.tensor([want[col] for _, _, want in TOKENS], dtype=torch.bfloat16)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def oracle(
    routed: np.ndarray,
    shared: np.ndarray | None,
    topk_idx: np.ndarray,
    t: int,
    position: str | None,
    *,
    descending: bool = False,
    round_each_add: bool = False,
    acc_dtype: type = np.float32,
) -> np.ndarray:
    """The kernel's combine per token as a NumPy loop (defaults), or a wrong variant.

    Args:
        routed: float32 ``[K, Tmax, H]`` (the routed rows, already quantized if any).
        shared: float32 ``[Tmax, H]`` or None.
        topk_idx: int ``[>= t, K]``.
        position: where the shared row is added: None, "first" or "last".
        descending, round_each_add, acc_dtype: wrong variants (slot order, a BF16 rounding
            after every add, a float64 accumulator).

    Returns:
        uint16 BF16 bits ``[t, H]``.
    """
    k = routed.shape[0]
    slots = range(k - 1, -1, -1) if descending else range(k)
    out = np.zeros((t, routed.shape[2]), dtype=np.uint16)
    for tok in range(t):
        terms = [routed[s, tok] for s in slots if topk_idx[tok, s] >= 0]
        if position == "first":
            terms.insert(0, shared[tok])
        elif position == "last":
            terms.append(shared[tok])
        acc = np.zeros(routed.shape[2], dtype=acc_dtype)
        for term in terms:
            acc = (acc + term.astype(acc_dtype)).astype(acc_dtype)
            if round_each_add:
                acc = acc.astype(np.float32).astype(ml_dtypes.bfloat16).astype(acc_dtype)
        out[tok] = bf16_bits(acc.astype(np.float32))
    return out


def wrong_variants(position: str | None) -> dict[str, dict]:
    """Oracle keyword sets for every wrong order this data must expose."""
    variants = {
        "descending": {"descending": True},
        "round-each-add": {"round_each_add": True},
        "float64-acc": {"acc_dtype": np.float64},
    }
    if position is not None:
        other = "last" if position == "first" else "first"
        variants[f"shared-{other}"] = {"position": other}
    return variants


def stored_rows(routed: torch.Tensor, shared: torch.Tensor, position: str | None) -> torch.Tensor:
    """The combine region ``[K (+1), Tmax, H]``: routed slot s at row s, a fused shared
    row at row K whatever its place in the sum (every build, DeepGEMM `layout/mega_moe.cuh`)."""
    if position is None:
        return routed.clone()
    return torch.cat([routed, shared[None]]).contiguous()


# A token for the weighted (FMA) combine of vLLM 0.34.0's `nvfp4_mega_moe`: rows -B and B with
# weight W. B * W = P + 2^-24 exactly, and fl(B * W) = P (a tie to even), so
# fma(B, W, fma(-B, W, 0)) = fma(B, W, -P) = 2^-24, while a rounded product then an add
# gives 0, and the descending order gives -2^-24.
B = 1.0 + 2.0**-7
W = 1.0 + 2.0**-17
FMA_WANT = 2.0**-24


def make_weighted_case(seed: int, hidden: int = 256):
    """:func:`make_case` plus FP32 weights ``[Tmax, K]`` and one more token (the FMA token).

    The crafted order tokens get weight 1.0 (``fma(row, 1, acc)`` is the add), the FMA
    token rows ``-B, B`` with weight ``W`` at the crafted columns (two invalid slots), and
    every other weight is random. Returns routed, shared, topk_idx, weights, t.
    """
    routed, shared, topk_idx, t = make_case(seed, hidden=hidden, tmax=len(TOKENS) + 3)
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.rand(topk_idx.shape, generator=g) + 0.5
    weights[:t] = 1.0
    fma_tok = t
    crafted = [col for col in CRAFTED if col < hidden]
    routed[:, fma_tok] = (torch.randn(K, hidden, generator=g) * 3).bfloat16()
    shared[fma_tok] = (torch.randn(hidden, generator=g) * 3).bfloat16()
    for col in crafted:
        lo = col // BLOCK * BLOCK
        routed[:, fma_tok, lo : lo + BLOCK] = 0.0
        shared[fma_tok, lo : lo + BLOCK] = 0.0
    routed[0, fma_tok, crafted] = -B
    routed[1, fma_tok, crafted] = B
    weights[fma_tok, :2] = W
    topk_idx[fma_tok] = torch.tensor([3, 7, -1, -1])
    routed[2:, fma_tok] = float("nan")
    return routed, shared, topk_idx, weights, t + 1


def fma_f32(a: np.ndarray, w: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``fl32(a * w + c)`` with one rounding, for data where the float64 sum is exact (the
    oracle asserts that: a product of two FP32 values is exact in float64)."""
    p = a.astype(np.float64) * w.astype(np.float64)
    s = p + c.astype(np.float64)
    z = s - p
    err = (p - (s - z)) + (c.astype(np.float64) - z)
    finite = np.isfinite(s)
    assert not np.any(err[finite] != 0), "the oracle's float64 sum is inexact for this data"
    return s.astype(np.float32)


def weighted_oracle(routed, shared, topk_idx, weights, t, position, *, descending=False,
                    fma=True) -> np.ndarray:
    """The NVFP4 kernel's combine: ``acc = fma(row, w, acc)`` over valid slots ascending,
    the shared row with weight 1.0 first or last, one BF16 rounding (uint16 bits ``[t, H]``).
    ``fma=False``: a rounded product then an add (wrong); ``descending``: wrong order."""
    k = routed.shape[0]
    slots = range(k - 1, -1, -1) if descending else range(k)
    out = np.zeros((t, routed.shape[2]), dtype=np.uint16)
    one = np.float32(1.0)
    for tok in range(t):
        terms = [(routed[s, tok], np.float32(weights[tok, s])) for s in slots
                 if topk_idx[tok, s] >= 0]
        if position == "first":
            terms.insert(0, (shared[tok], one))
        elif position == "last":
            terms.append((shared[tok], one))
        acc = np.zeros(routed.shape[2], dtype=np.float32)
        for row, w in terms:
            row = row.astype(np.float32)
            if fma:
                acc = fma_f32(row, np.full_like(row, w), acc)
            else:
                acc = (acc + (row * w).astype(np.float32)).astype(np.float32)
        out[tok] = bf16_bits(acc)
    return out
