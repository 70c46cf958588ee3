# Triton's JIT functions take Triton values (tensors, constexprs) that carry no Python type,
# and triton.jit is untyped: mypy checks the launcher that calls them instead.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernel of :mod:`moewire.kernels.logit_metrics`: one program per row, two passes
over the row's vocabulary (the math is that module's docstring)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _expm1_small(x):
    """``exp(x) - 1`` for ``|x| < 0.5`` (FP64) without the cancellation of the subtraction:
    Taylor to the ``x^16 / 16!`` term (truncation below 1e-19 relative)."""
    p = x * 0.0 + 4.779477332387385e-14
    p = p * x + 7.647163731819816e-13
    p = p * x + 1.1470745597729725e-11
    p = p * x + 1.6059043836821613e-10
    p = p * x + 2.08767569878681e-09
    p = p * x + 2.505210838544172e-08
    p = p * x + 2.755731922398589e-07
    p = p * x + 2.7557319223985893e-06
    p = p * x + 2.48015873015873e-05
    p = p * x + 0.0001984126984126984
    p = p * x + 0.001388888888888889
    p = p * x + 0.008333333333333333
    p = p * x + 0.041666666666666664
    p = p * x + 0.16666666666666666
    p = p * x + 0.5
    p = p * x + 1.0
    return p * x


@triton.jit
def _first_max(best, best_at, z, at):
    """Running per-lane maximum and the first index that holds it; NaN counts as the
    largest value (``torch.argmax``'s rule), so a row holding NaN points at its first NaN."""
    take = (z > best) | ((z != z) & (best == best))
    return tl.where(take, z, best), tl.where(take, at, best_at)


@triton.jit
def _row_argmax(best, best_at, BIG: tl.constexpr):
    """The maximum of the lanes and the first index holding it."""
    nan = best != best
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(nan, -float("inf"), best), 0)
    hit = tl.where(has_nan, nan, best == top)
    return tl.where(has_nan, float("nan"), top), tl.min(tl.where(hit, best_at, BIG), 0)


@triton.jit
def logit_sums_kernel(z_ptr, z0_ptr, t_ptr, f32_ptr, f64_ptr, i32_ptr, V: tl.constexpr, stride_z,
                      stride_z0, BLOCK: tl.constexpr):
    """Row ``r``: pass 1 the maxima ``m``/``m0``, their first indices and ``z[t]``; pass 2
    ``S``, ``S0``, ``A``, ``B`` summed per lane in FP64 (FP32 exponentials, FP64 terms;
    lanes past ``V`` add 0). Writes ``f32[r] = (m, z[t])``, ``f64[r] = (S, S0, A, B)``,
    ``i32[r] = (argmax z, argmax z0)``."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    z_row = z_ptr + r * stride_z
    z0_row = z0_ptr + r * stride_z0
    best = tl.full((BLOCK,), -float("inf"), tl.float32)
    best0 = tl.full((BLOCK,), -float("inf"), tl.float32)
    at = tl.zeros((BLOCK,), tl.int32)
    at0 = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        z = tl.load(z_row + idx, mask=ok, other=-float("inf")).to(tl.float32)
        z0 = tl.load(z0_row + idx, mask=ok, other=-float("inf")).to(tl.float32)
        best, at = _first_max(best, at, z, idx)
        best0, at0 = _first_max(best0, at0, z0, idx)
    m, top = _row_argmax(best, at, 2147483647)
    m0, top0 = _row_argmax(best0, at0, 2147483647)
    target = tl.load(t_ptr + r)
    zt = tl.load(z_row + target).to(tl.float32)

    shift = (m0 - m).to(tl.float64)
    s = tl.zeros((BLOCK,), tl.float64)
    s0 = tl.zeros((BLOCK,), tl.float64)
    a = tl.zeros((BLOCK,), tl.float64)
    b = tl.zeros((BLOCK,), tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        z = tl.load(z_row + idx, mask=ok, other=0.0).to(tl.float32)
        z0 = tl.load(z0_row + idx, mask=ok, other=0.0).to(tl.float32)
        e = tl.where(ok, tl.exp(z - m), 0.0)
        e0 = tl.where(ok, tl.exp(z0 - m0), 0.0)
        # z0 - z is exact in FP32 where the runs are close (Sterbenz); u and the terms of A
        # and B are FP64, so the cancellation between A / S0 and log1p(B / S0) (both about
        # E[u], the KL about Var(u) / 2) costs nothing of the KL's precision.
        u = (z0 - z).to(tl.float64) - shift
        e0d = e0.to(tl.float64)
        # e0 * (exp(-u) - 1) = e - e0: the Taylor form where the two nearly cancel, the
        # difference (of two values <= 1, no overflow) where they do not.
        diff = tl.where(tl.abs(u) < 0.5, e0d * _expm1_small(-u), (e - e0).to(tl.float64))
        s += e.to(tl.float64)
        s0 += e0d
        a += e0d * u
        b += diff
    tl.store(f32_ptr + 2 * r, m)
    tl.store(f32_ptr + 2 * r + 1, zt)
    tl.store(f64_ptr + 4 * r, tl.sum(s, 0))
    tl.store(f64_ptr + 4 * r + 1, tl.sum(s0, 0))
    tl.store(f64_ptr + 4 * r + 2, tl.sum(a, 0))
    tl.store(f64_ptr + 4 * r + 3, tl.sum(b, 0))
    tl.store(i32_ptr + 2 * r, top)
    tl.store(i32_ptr + 2 * r + 1, top0)
