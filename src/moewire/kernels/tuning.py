"""How the Triton launches are shaped: columns and warps per program, and whether the
combine's slot loop is unrolled. Tuning only: every choice gives the same bits.

The defaults come from the tuning grids on an H200 (``benchmarks/kernel_variants.py``,
``benchmarks/results/h200-v5/``).
"""

from __future__ import annotations

from moewire.format_table import FormatFacts, facts

__all__ = ["block_h", "num_warps", "triton_next_pow2", "unroll"]

# Columns per program: a power of two holding whole blocks of every format; a row-scaled
# format (nvfp4_token) takes the whole row (its global scale is the row's amax).
_BLOCK_H = 1024


def unroll(fmt: FormatFacts | str, k: int, check: bool) -> bool:
    """Whether the combine kernel's slot loop is unrolled by default: the format row's
    ``unroll`` rule (``moewire.format_table.UNROLL_RULES``), from the tuning grid of
    ``benchmarks/kernel_variants.py`` on an H200 (T = 8192, each shape at its default
    program size; benchmarks/results/h200-v5/: ``variants_*`` with the check, ``nochk_*``
    without). Unrolling overlaps more rows, rolling needs fewer registers:

    - ``always``, BF16, MXFP8, MXFP4: unrolled on every shape, or within 3%.
    - ``up_to_k8``, the FP8 formats and the real kernels' FP8 combine formats (the latter,
      and ``fp8_e4m3fnuz``, not tuned separately: they share the FP8 formats' shape):
      unrolled up to k = 8 (FP8 with the check 279 vs 296 us at 8 x 8192 x 7168), rolled at
      Kimi-K3's k = 16 (FP8 block 128 with the check 311 vs 335 us; within 1% without it).
    - ``unchecked_up_to_k8``, NVFP4 and the 16e2m1xbf16 combines (these take NVFP4's split
      tile and its rule): with the check it holds the expected tile and the unchecked sum
      besides, and unrolled it needs 116+ registers a thread (8 programs an SM) where
      rolled takes 96 (10): rolled is faster (395 vs 425 us at 8 x 8192 x 7168, 364 vs
      452 at k = 16, within 1% at k = 6). Without the check it is unrolled up to k = 8
      (366 vs 383 us; V4-Pro 266 vs 294) and rolled at k = 16 (372 vs 423 us).
    - ``never``, nvfp4_token: rolled (whole-row programs: registers, compile time).

    Args:
        fmt: the format's row of ``moewire.format_table`` or its name.
        k: routed slots per token.
        check: whether the layout check runs in the same pass.
    """
    rule = facts(fmt).unroll
    if rule == "unchecked_up_to_k8":
        return not check and k <= 8
    if rule == "up_to_k8":
        return k <= 8
    return rule == "always"


def num_warps(fmt: FormatFacts | str, block_h: int, num_warps: int | None) -> int:
    """Warps per program: 8 columns per thread (at most 16 warps; a 128-column program
    gets one warp); a format with the split tile (its row's ``split_tile``) one 16-element
    block per thread."""
    if num_warps:
        return num_warps
    if facts(fmt).split_tile:
        return max(1, min(16, block_h // 512))
    return max(1, min(16, block_h // 256))


def block_h(fmt: FormatFacts | str, hidden: int, block_h: int | None, *,
            pad_least: bool = True) -> int:
    """Columns per program: ``block_h`` if given; else the whole row (a row-scaled format,
    ``nvfp4_token``: its row's ``whole_row``; or a row shorter than 1024 columns); else
    1024, or with ``pad_least`` (the combine) of 1024, 512 and 256 the one that pads the
    row's last program least, the larger on a tie.

    The combine takes ``pad_least``: at H = 3584 (Kimi-K3) seven full 512-column programs
    beat four 1024-column ones whose last is half empty but still runs the slot loop. The
    dispatch QDQ (one pass, no loop) does not: there 512-column programs are 18% slower
    than 1024 at H = 3584 on an H200 (36.2 vs 30.5 us for FP8 at T = 8192, every format
    alike; ``benchmarks/results/h200-v5/qdq_block_grid.log``)."""
    whole_row = triton_next_pow2(hidden)
    if facts(fmt).whole_row:
        return whole_row
    if block_h is not None:
        return min(block_h, whole_row)
    if whole_row <= _BLOCK_H or not pad_least:
        return min(whole_row, _BLOCK_H)
    return min((_BLOCK_H, _BLOCK_H // 2, _BLOCK_H // 4),
               key=lambda bh: (-hidden % bh, -bh))


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 128, the largest block of any format)."""
    return max(128, 1 << (max(n, 1) - 1).bit_length())


