# Triton's JIT functions take Triton values (tensors, constexprs) that carry no Python type,
# and triton.jit is untyped: mypy checks the launchers that call them instead.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels: row-local fake quantization and the fused combine re-sum.

Every format's math here is the math of its torch reference in ``moewire.formats``
(ModelOpt 0.47's fake quantization), step for step, with the same FP32 roundings:

- exact division (``div_rn``), never Triton's default approximate ``/``;
- FMA contraction is switched off at launch (``enable_fp_fusion=False``), so a multiply
  followed by an add rounds twice, as torch does;
- a division by a constant (``amax / 448``, ``amax / 2688``) is a multiplication by the
  FP32 reciprocal, ``a * fl(1/c)``, as the references write it (``mul_recip``: torch's
  CUDA rule, which DeepGEMM's and ModelOpt's own casts follow on the GPU), on the GPU and
  under the interpreter alike;
- block maxima propagate NaN, as ``torch.amax`` does;
- E4M3 rounding clamps to ±448 then casts (RNE); E4M3 FNUZ rounding (MI300's FP8) is
  E4M3's of the doubled value, halved, with 240 above 232 and no negative zero; E2M1
  rounding is RNE onto
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} by adding and subtracting a power-of-two "magic" number
  whose ulp is the grid step, which gives exactly the reference's tie rules;
- NVFP4's per-element quotient ``fl(|x| / bs)`` is computed without a per-element division
  (:func:`_div_by_block`): one exact reciprocal per 16-element block, then Markstein's
  correction (two FMAs), which gives the correctly rounded quotient bit for bit;
- ``rcp.approx.ftz.f32``, where a format takes the device's approximate reciprocal
  (``flashinfer_nvfp4``), is the correctly rounded one moved by the measured offset of its
  input's significand (:func:`_rcp_approx_bf16_decode_scale`), so CPU, interpreter and GPU
  agree bit for bit;
- an FMA is one rounding: ``tl.fma`` on the GPU; under the interpreter (whose ``fma`` is a
  multiply then an add, two roundings) :func:`_fma` computes it exactly in FP64 with
  round-to-odd.

A format is its row of ``moewire.format_table``: the launchers pass its ``kernel_code`` as
``FMT`` (the branch of :func:`_qdq` that computes it) and its ``split_tile`` as ``SPLIT``
(the tile layout, :func:`_tile_cols`; the 16-element block branches assert it).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from moewire.kernels.rcp_approx import DOWN_AT as RCP_APPROX_DOWN_AT
from moewire.kernels.rcp_approx import UP_AT as RCP_APPROX_UP_AT

# FP32 reciprocals of the constants the references divide by, each one FP32 division.
_INV_448 = tl.constexpr(float(np.float32(1.0) / np.float32(448.0)))
_INV_2688 = tl.constexpr(float(np.float32(1.0) / np.float32(2688.0)))
_INV_6 = tl.constexpr(float(np.float32(1.0) / np.float32(6.0)))
_INV_240 = tl.constexpr(float(np.float32(1.0) / np.float32(240.0)))
# FlashInfer's reciprocal mask, cutlass.Float32(1e30).
_MASK_1E30 = tl.constexpr(float(np.float32(1e30)))
# TensorRT-LLM's floor of the block amax (torch.clamp(min=1e-30) on an FP32 tensor).
_TRTLLM_FLOOR = tl.constexpr(float(np.float32(1e-30)))
_FLT_MIN = tl.constexpr(float(np.finfo(np.float32).tiny))
# rcp.approx.ftz.f32's offset from the correctly rounded reciprocal on a BF16 amax's NVFP4
# decode scale, by the amax's 7 significand bits (kernels.rcp_approx, measured), as eight
# 16-bit words per direction: bit (m & 15) of word m >> 4.
def _rcp_words(at: tuple[int, ...]) -> tuple[int, ...]:
    words = [0] * 8
    for m in at:
        words[m >> 4] |= 1 << (m & 15)
    return tuple(words)


_RCP_UP = tl.constexpr(_rcp_words(RCP_APPROX_UP_AT))
_RCP_DOWN = tl.constexpr(_rcp_words(RCP_APPROX_DOWN_AT))
# NVFP4's floor of fl(6 gs) before its reciprocal (see _nvfp4_consts).
_GS6_FLOOR = tl.constexpr(2.0**-90)

_NAN = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=_NAN)


@triton.jit
def _e4m3(v, HW_CAST: tl.constexpr):
    """clamp(v, ±448) then RNE onto E4M3, back in FP32 (NaN stays NaN, -0.0 stays -0.0).

    ``HW_CAST``: the GPU's saturating RNE convert (``cvt.rn.satfinite.e4m3x2.f32``), whose
    saturation is the clamp (a finite value above 448 rounds to 448 either way).
    Otherwise (Triton's interpreter, whose FP8 cast rounds ties away and flushes
    subnormals) the same rounding from exact FP32 steps: with ``e = max(floor(log2|v|),
    -6)`` the E4M3 step is ``2^(e-3)``, the ulp of ``magic = 1.5 * 2^(e+20)``, so
    ``(v + magic) - magic`` rounds ``v`` to the grid, ties to even; the sign is put back
    for results that round to zero.
    """
    if HW_CAST:
        # ``satfinite`` is the clamp: out-of-range finite values and infinities go to ±448.
        out = v.to(tl.float8e4nv).to(tl.float32)
    else:
        v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=_NAN), 448.0, propagate_nan=_NAN)
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        magic = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
        r = ((v + magic) - magic).to(tl.int32, bitcast=True)
        out = (r | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _e4m3fnuz(v, HW_CAST: tl.constexpr):
    """clamp(v, ±240) then RNE onto E4M3 FNUZ, back in FP32 (NaN stays NaN; no -0.0).

    FNUZ's grid is E4M3's halved, plus 240 (1.875 * 2^7, where E4M3 has its NaN): so
    ``_e4m3(2 v) / 2`` (exact scalings) for ``|v| <= 232`` and ``±240`` above (232, the
    midpoint of 224 and 240, goes to 224, the even one), and a zero result is +0.0.
    """
    v = tl.minimum(tl.maximum(v, -240.0, propagate_nan=_NAN), 240.0, propagate_nan=_NAN)
    r = _e4m3(v * 2.0, HW_CAST) * 0.5
    r = tl.where(tl.abs(v) > 232.0, tl.where(v < 0, -240.0, 240.0), r)
    return tl.where(r == 0.0, 0.0, r)


@triton.jit
def _fp8_element(v, FNUZ: tl.constexpr, HW_CAST: tl.constexpr):
    """E4M3 FNUZ (``FNUZ``) or OCP E4M3: saturating RNE, in FP32."""
    if FNUZ:
        out = _e4m3fnuz(v, HW_CAST)
    else:
        out = _e4m3(v, HW_CAST)
    return out


@triton.jit
def _round_bf16(v, HW_CAST: tl.constexpr):
    """FP32 -> nearest BF16 (RNE), returned in FP32 (so a later cast to BF16 is exact).

    ``HW_CAST``: the GPU's ``cvt.rn.bf16x2.f32`` (two elements per instruction), widened
    back by placing each half in the top 16 bits; otherwise (the interpreter truncates)
    RNE on the bits: add ``0x7FFF`` plus the lowest kept bit, clear the 16 dropped bits.
    """
    if HW_CAST:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
            "and.b32 $1, t, 0xFFFF0000; }",
            "=r,=r,r,r", [v], dtype=tl.float32, is_pure=True, pack=2)
    else:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        out = bits.to(tl.float32, bitcast=True)
    return out


@triton.jit
def _widen_bf16(x, HW_CAST: tl.constexpr):
    """BF16 -> FP32 (exact). ``HW_CAST``: one shift or mask per element on the packed pair."""
    if HW_CAST:
        out = tl.inline_asm_elementwise(
            "shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;",
            "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _fma(a, b, c, HW_CAST: tl.constexpr):
    """``fl(a * b + c)`` in FP32 with one rounding (CUDA's ``fmaf``, RNE).

    ``HW_CAST``: ``tl.fma`` (the GPU's ``fma.rn.f32``). Otherwise (the interpreter's
    ``fma`` rounds twice) exactly from FP64: the product of two FP32 values is exact in
    FP64; ``s = p + c`` and its exact error (TwoSum) give the round-to-odd FP64 sum, and
    round-to-odd FP64 (53 >= 24 + 2 bits) rounded to FP32 is the correctly rounded result.
    """
    if HW_CAST:
        out = tl.fma(a, b, c)
    else:
        p = a.to(tl.float64) * b.to(tl.float64)
        c64 = c.to(tl.float64)
        s = p + c64
        z = s - c64
        err = (c64 - (s - z)) + (p - z)
        bits = s.to(tl.int64, bitcast=True)
        # Round to odd: an inexact sum with an even last bit moves one ulp towards the
        # exact value (away from zero when err has the sign of s, else towards it).
        step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)
        fix = (err != 0) & ((bits & 1) == 0) & (s == s) & (tl.abs(s) < float("inf"))
        out = tl.where(fix, bits + step, bits).to(tl.float64, bitcast=True).to(tl.float32)
    return out


@triton.jit
def _fma_exact(a, b, c, HW_CAST: tl.constexpr):
    """``fl(a * b + c)`` for an ``a * b`` that is exact in FP32 (a power of two times a
    short constant): one ``fma`` on the GPU, a multiply then an add elsewhere (the same
    single rounding, since the product is exact)."""
    if HW_CAST:
        out = tl.fma(a, b, c)
    else:
        out = a * b + c
    return out


@triton.jit
def _div_by(a, d_neg, r, HW_CAST: tl.constexpr, FINITE: tl.constexpr):
    """``fl(a / d)`` (FP32, RNE) from ``r = fl(1 / d)`` and ``d_neg = -d``, broadcast to ``a``.

    Per element ``q = fl(a * r)`` is within an ulp of the quotient, the remainder ``e = a -
    q * d`` (``fma(q, d_neg, a)``) is exact in FP32 and ``fl(q + e * r)`` is the correctly
    rounded quotient (Markstein's theorem: ``r`` correctly rounded, ``q`` faithful; checked
    in ``tests/kernels/test_division_free.py`` against FP32 division). Where ``e`` is NaN
    (``a`` or ``d`` infinite, or ``a`` NaN) ``q`` is already the IEEE quotient (inf, 0 or NaN)
    and is kept (``FINITE``: the caller knows ``a`` finite and ``a / d`` far from overflow,
    and skips that select). A subnormal quotient (below 2^-126, where the theorem's
    no-underflow premise fails) may be an ulp off; the callers map every such quotient to 0
    (E2M1) or to an E4M3 scale that the scale floor replaces.
    """
    q = a * r
    e = _fma(q, d_neg, a, HW_CAST)
    q2 = _fma(e, r, q, HW_CAST)
    if not FINITE:
        q2 = tl.where(e == e, q2, q)
    return q2


@triton.jit
def _div_by_block(a, bs, HW_CAST: tl.constexpr, FINITE: tl.constexpr):
    """``fl(a / bs)`` (FP32, RNE) for ``a`` [NB, 16] and one divisor ``bs`` [NB, 1] per block:
    one exact division per block, ``r = fl(1 / bs)``, then :func:`_div_by` per element."""
    r = tl.math.div_rn(tl.full(bs.shape, 1.0, tl.float32), bs)
    # ``-bs`` as ``bs * -1.0``, once per block (Triton lowers ``-x`` as ``0 - x``).
    return _div_by(a, tl.broadcast_to(bs * -1.0, a.shape), tl.broadcast_to(r, a.shape),
                   HW_CAST, FINITE)


@triton.jit
def _e2m1_magnitude(a, HW_CAST: tl.constexpr, BOUNDED: tl.constexpr):
    """a >= 0 (or NaN) -> RNE onto the E2M1 magnitudes, saturating at 6 (NaN stays NaN).

    Clamp to 6 first (6 is on the grid, so clamping then rounding is rounding then
    saturating), unless ``BOUNDED`` (the caller knows ``a < 7``, which rounds to at most 6
    anyway). Then ``(a + M) - M`` with ``M = 1.5 * 2^22 * p``, ``p = 2^max(E, 0)``
    (``E`` the exponent of ``a``, read from its bits): M's ulp is the grid step (0.5 below
    2, 1 in [2, 4), 2 in [4, 6]) and M is an even multiple of it, so the sum rounds ``a``
    to the grid, ties to even. ``p * ±1.5*2^22`` is exact, so both steps are single FMAs.
    """
    if not BOUNDED:
        a = tl.minimum(a, 6.0, propagate_nan=_NAN)
    p = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    p = p.to(tl.float32, bitcast=True)
    s = _fma_exact(p, 6291456.0, a, HW_CAST)
    return _fma_exact(p, -6291456.0, s, HW_CAST)


@triton.jit
def _table_bit(m, W: tl.constexpr):
    """Bit ``m & 15`` of word ``m >> 4`` of the eight 16-bit words ``W`` (``m`` in 0..127)."""
    hi = m >> 4
    word = tl.where(hi < 4,
                    tl.where(hi < 2, tl.where(hi == 0, W[0], W[1]),
                             tl.where(hi == 2, W[2], W[3])),
                    tl.where(hi < 6, tl.where(hi == 4, W[4], W[5]),
                             tl.where(hi == 6, W[6], W[7])))
    return (word >> (m & 15)) & 1


@triton.jit
def _rcp_approx_bf16_decode_scale(ds, a):
    """``rcp.approx.ftz.f32(ds)`` for ``ds = fl(a * fl(1/6)) >= 2^-126`` with ``a``
    BF16-valued (``formats._numerics.rcp_approx_bf16_decode_scale``): the correctly rounded
    reciprocal moved by the measured offset of ``a``'s significand, on the bits."""
    m = (a.to(tl.int32, bitcast=True) >> 16) & 0x7F
    offset = _table_bit(m, _RCP_UP) - _table_bit(m, _RCP_DOWN)
    exact = tl.math.div_rn(tl.full(ds.shape, 1.0, tl.float32), ds)
    return (exact.to(tl.int32, bitcast=True) + offset).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):
    """2^e as FP32 for int32 e in [-149, 127] (subnormals included), exactly."""
    normal = tl.maximum(e + 127, 1) << 23
    subnormal = tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def _ceil_pow2_ue8m0(v):
    """DeepGEMM's ceil_to_ue8m0 from the bits of |v| (NaN and inf -> 2^127, 0 -> 2^-126)."""
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 254)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _block_max(xb):
    """The NaN-propagating max of |x| per block of a split tile [NB, 8, 2]: [NB, 1, 1]."""
    ax = tl.abs(xb)
    return tl.reduce(tl.reduce(ax, 2, _max_nan, keep_dims=True), 1, _max_nan, keep_dims=True)


@triton.jit
def _bf16_block_decode_scale(xb, HW_CAST: tl.constexpr, SPLIT: tl.constexpr):
    """The BF16 decode-scale rule of TRT-LLM's and FlashInfer's NVFP4 casts, per block of a
    split tile [NB, 8, 2]: ``(finite, a, ds)``, [NB, 1, 1] each: whether the block's
    NaN-propagating max |x| is finite, that max rounded to BF16 (0 when it is not), and
    ``ds = fl(a * fl(1/6))``."""
    tl.static_assert(SPLIT, "16-element block tiles hold whole blocks per thread (SPLIT)")
    bmax = _block_max(xb)
    finite = bmax < float("inf")
    a = _round_bf16(tl.where(finite, bmax, 0.0), HW_CAST)
    return finite, a, a * _INV_6


@triton.jit
def _e2m1_qdq(xb, enc, ds, finite, HW_CAST: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """A split tile's blocks to E2M1 and back, given each block's encode and decode scale
    and whether its max is finite (else NaN): ``e2m1(xb * enc) * ds``, the E2M1 value
    carrying the sign bit of ``xb * enc``; without ``SIGNED_ZERO`` a zero magnitude is +0."""
    v = xb * enc
    mag = _e2m1_magnitude(tl.abs(v), HW_CAST, False)
    sign_bit = v.to(tl.int32, bitcast=True) & -2147483648
    if not SIGNED_ZERO:
        sign_bit = tl.where(mag == 0.0, 0, sign_bit)
    q = (mag.to(tl.int32, bitcast=True) | sign_bit).to(tl.float32, bitcast=True)
    return q * tl.broadcast_to(tl.where(finite, ds, float("nan")), q.shape)


@triton.jit
def _nvfp4_consts(gs):
    """What NVFP4's block-scale division needs from the global scale ``gs``, computed once
    per program (per row for ``nvfp4_token``) instead of once per block:
    ``(gs, -gs6, fl(1 / gs6), cap)`` with ``gs6 = max(fl(6 gs), 2^-90)``, and
    ``cap = min(fl(449 gs6), FLT_MAX)``.

    The block max is capped at ``cap`` before the division: every quotient at or above
    448 gives the E4M3 scale 448 (the reference's ``min(bmax / gs6, 448)``), and so does
    ``cap / gs6`` (>= 448 after rounding, and below 464, which E4M3 rounds to 448 too); the
    cap keeps the quotient finite (an infinite block max included), so :func:`_div_by`
    needs no NaN select. ``gs6`` below 2^-90 (a global scale far below any BF16 value's
    reach) is raised to 2^-90 so that its reciprocal is finite: there every block scale is
    at most ``448 gs < 1e-5``, which the reference's floor replaces by 1, whatever the
    quotient was.
    """
    gs6 = tl.maximum(6.0 * gs, _GS6_FLOOR)
    r6 = tl.math.div_rn(tl.full(gs6.shape, 1.0, tl.float32), gs6)
    cap = tl.minimum(gs6 * 449.0, 3.4028234663852886e38)
    return gs, gs6 * -1.0, r6, cap


@triton.jit
def _nvfp4_blocks(xb, sc, ZERO_SIGN: tl.constexpr, HW_CAST: tl.constexpr):
    """ModelOpt NVFP4 on blocks ``xb`` FP32 [NB, 8, 2] (each block's two halves, see
    :func:`_load_tile`) with the global scale's constants ``sc`` (:func:`_nvfp4_consts`,
    each FP32 broadcastable).

    ``ZERO_SIGN``: the reference's signed zeros (``sign(x) * q * bs``: -0.0 for a negative
    ``x`` that rounds to 0, +0.0 for either zero ``x``). Without it the sign bit of ``x``
    is copied onto the magnitude (one instruction), which differs only for ``x = -0.0``
    (-0.0 instead of +0.0): the combine may do that, since its sum starts at +0.0 and so is
    never -0.0, and adding either zero to it gives the same bits.
    """
    gs, gs6_neg, r6, cap6 = sc
    ax = tl.abs(xb)
    bmax = tl.minimum(_block_max(xb), cap6, propagate_nan=_NAN)
    # fl(bmax / gs6) without a division per block; _e4m3 saturates at 448 (the reference's
    # min(., 448)).
    quotient = _div_by(bmax, gs6_neg + tl.zeros_like(bmax), r6 + tl.zeros_like(bmax),
                       HW_CAST, True)
    bs = _e4m3(quotient, HW_CAST) * gs
    bs = tl.where(bs < 1e-5, 1.0, bs)
    # |x| capped at cap = min(fl(6.5 bs), FLT_MAX) changes no result: above the cap the
    # quotient is > 6.49, which saturates to 6, and so does cap / bs (< 7); an infinite x
    # becomes finite. So the quotient needs no NaN select and the rounding no clamp. (A NaN
    # x makes its block's bs NaN, and the result NaN, whatever the cap does with it.)
    cap = tl.minimum(bs * 6.5, 3.4028234663852886e38)
    q = _e2m1_magnitude(_div_by_block(tl.minimum(ax, tl.broadcast_to(cap, ax.shape)), bs,
                                      HW_CAST, True), HW_CAST, True)
    mag = q * tl.broadcast_to(bs, q.shape)
    if ZERO_SIGN:
        out = tl.where(xb < 0, mag * -1.0, mag)  # (Triton lowers -mag as 0 - mag: +0.0)
    else:
        sign = xb.to(tl.int32, bitcast=True) & -2147483648
        out = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _tensor_consts(amax, FMT: tl.constexpr):
    """What a format computes from its FP32 per-tensor ``amax`` (``fp8``, ``nvfp4``), once
    per program and before any loop over rows: ``fp8`` (``fp8_e4m3fnuz``: 240 for 448):
    ``(s, fl(1 / s), 0, 0)`` with ``s = 448 * fl(1 / safe)`` (ModelOpt's ``448 / safe``,
    evaluated as torch does); ``nvfp4``:
    :func:`_nvfp4_consts` of ``gs = fl(amax * fl(1 / 2688))`` (``1e-12`` unless ``gs > 0``:
    ``amax <= 0`` or NaN, or a subnormal amax whose product underflows to 0);
    every other format: unused zeros."""
    if FMT == 1 or FMT == 13:
        FP8_MAX: tl.constexpr = 448.0 if FMT == 1 else 240.0
        safe = tl.where(amax > 5.960464477539063e-08, amax, 1.0)
        s = FP8_MAX * tl.math.div_rn(1.0, safe)
        out = s, tl.math.div_rn(1.0, s), 0.0, 0.0
    elif FMT == 7:
        gs = amax * _INV_2688
        out = _nvfp4_consts(tl.where(gs > 0, gs, 1e-12))
    else:
        out = amax, 0.0, 0.0, 0.0
    return out


@triton.jit
def _qdq(x, sc, FMT: tl.constexpr, BLOCK_H: tl.constexpr, ZERO_SIGN: tl.constexpr,
         SPLIT: tl.constexpr, HW_CAST: tl.constexpr):
    """Fake-quantize one row chunk ``x`` FP32 [BLOCK_H] (whole blocks; a masked tail is 0);
    for the 16-element block formats (``SPLIT``: NVFP4's, the 16e2m1xbf16 combines)
    [BLOCK_H // 16, 8, 2] (see :func:`_load_tile`).

    ``sc``: the format's per-tensor constants (:func:`_tensor_consts` of its amax).
    ``ZERO_SIGN``: NVFP4's signed zeros exactly as the reference (see
    :func:`_nvfp4_blocks`; the combine passes False).
    Returns FP32 [BLOCK_H], before the cast to the output dtype. ``nvfp4_token`` needs the
    whole row in ``x`` (BLOCK_H >= H).
    """
    if FMT == 0:
        out = x
    elif FMT == 1:
        s, inv_s, _, _ = sc
        out = _e4m3(x * s, HW_CAST) * inv_s
    elif FMT <= 4:
        BS: tl.constexpr = 32 if FMT == 4 else 128
        xb = tl.reshape(x, (BLOCK_H // BS, BS))
        bmax = tl.reduce(tl.abs(xb), 1, _max_nan, keep_dims=True)
        sf = tl.maximum(bmax, 1e-4, propagate_nan=_NAN) * _INV_448
        if FMT != 2:
            sf = _ceil_pow2_ue8m0(sf)
        inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
        out = tl.reshape(_e4m3(xb * inv, HW_CAST) * sf, (BLOCK_H,))
    elif FMT <= 6:
        EMAX: tl.constexpr = 8 if FMT == 5 else 2
        xb = tl.reshape(x, (BLOCK_H // 32, 32))
        bmax = tl.reduce(tl.abs(xb), 1, _max_nan, keep_dims=True)
        finite = bmax < float("inf")
        usable = tl.where(finite & (bmax > 0), bmax, 1.0)
        e = ((usable.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAX
        e = tl.maximum(e, -127)
        v = xb * _pow2(-e)
        if FMT == 5:
            q = _e4m3(v, HW_CAST)
        else:
            mag = _e2m1_magnitude(tl.abs(v), HW_CAST, False)
            sign_bit = v.to(tl.int32, bitcast=True) & -2147483648
            q = (mag.to(tl.int32, bitcast=True) | sign_bit).to(tl.float32, bitcast=True)
        # A block with a NaN or an infinity is NaN: its scale is NaN (one select per block).
        scale = tl.where(finite, _pow2(e), float("nan"))
        out = tl.reshape(q * tl.broadcast_to(scale, q.shape), (BLOCK_H,))
    elif FMT <= 8:
        tl.static_assert(SPLIT, "NVFP4 tiles hold whole blocks per thread (SPLIT)")
        if FMT == 7:
            out = _nvfp4_blocks(x, sc, ZERO_SIGN, HW_CAST)
        else:
            # The row's own global scale, 1e-12 where it is 0 (a zero row, or a subnormal
            # row max whose product underflows); a NaN row keeps a NaN one.
            gs = tl.reduce(tl.abs(x), None, _max_nan) * _INV_2688
            out = _nvfp4_blocks(x, _nvfp4_consts(tl.where(gs != 0, gs, 1e-12)), ZERO_SIGN,
                                HW_CAST)
    elif FMT <= 11 or FMT == 20:
        # deepgemm_fp8_combine (9), trtllm_32e4m3xe8m0 (10), te_mxfp8 (11) and
        # flydsl_fp8_blockwise_1x32 (20, DeepGEMM's rule on 32 columns).
        BS2: tl.constexpr = 128 if FMT == 9 else 32
        xb = tl.reshape(x, (BLOCK_H // BS2, BS2))
        bmax = tl.reduce(tl.abs(xb), 1, _max_nan, keep_dims=True)
        finite = bmax < float("inf")
        usable = tl.where(finite, bmax, 0.0)
        if FMT == 10:
            usable = tl.where(usable == 0.0, 0.0, tl.maximum(usable, _TRTLLM_FLOOR))
        v = usable * _INV_448
        bits = v.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        inexact = ((bits & 0x7FFFFF) != 0).to(tl.int32)
        if FMT == 9 or FMT == 20:
            # fast_log2_ceil (FlyDSL: the byte E + (M != 0)); a zero block (-127)
            # dequantizes with 0.0 (fast_pow2(-127); FlyDSL's float of byte 0).
            e = biased - 127 + inexact
            recip = _pow2(-e)
            scale = tl.where(e == -127, 0.0, _pow2(e))
        elif FMT == 10:
            e = tl.minimum(tl.maximum(biased - 127 + inexact, -127), 127)
            e = tl.where(usable == 0.0, -127, e)
            recip = _pow2(-e)
            scale = _pow2(e)
        else:
            # cvt.rp.satfinite.ue8m0: a subnormal rounds up to byte 0 or 1; exp2f_rcp(0) = 1.
            sub = ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
            byte = tl.where(biased == 0, sub, tl.minimum(biased + inexact, 254))
            recip = tl.where(byte == 0, 1.0, _pow2(127 - byte))
            scale = _pow2(byte - 127)
        q = _e4m3(xb * recip, HW_CAST)
        scale = tl.where(finite, scale, float("nan"))
        out = tl.reshape(q * tl.broadcast_to(scale, q.shape), (BLOCK_H,))
    elif FMT == 12:
        # trtllm_16e2m1xbf16 on the split tile [BLOCK_H // 16, 8, 2]: one thread per block.
        finite, _, ds = _bf16_block_decode_scale(x, HW_CAST, SPLIT)
        # A subnormal decode scale is flushed (the encoder's rcp.approx.ftz): zeros.
        enc = tl.where(ds >= _FLT_MIN, tl.math.div_rn(tl.full(ds.shape, 1.0, tl.float32), ds),
                       0.0)
        out = _e2m1_qdq(x, enc, ds, finite, HW_CAST, False)
    elif FMT == 13:
        # fp8_e4m3fnuz: fp8's per-tensor rule with FNUZ's 240 (scale in ``sc``).
        s, inv_s, _, _ = sc
        out = _e4m3fnuz(x * s, HW_CAST) * inv_s
    elif FMT == 14:
        # flashinfer_mxfp8: BF16 amax, cvt.rp to UE8M0, the masked reciprocal.
        xb = tl.reshape(x, (BLOCK_H // 32, 32))
        bmax = tl.reduce(tl.abs(xb), 1, _max_nan, keep_dims=True)
        finite = bmax < float("inf")
        a = _round_bf16(tl.where(finite, bmax, 0.0), HW_CAST)
        v = a * _INV_448
        bits = v.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        inexact = ((bits & 0x7FFFFF) != 0).to(tl.int32)
        sub = ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
        byte = tl.where(biased == 0, sub, tl.minimum(biased + inexact, 254))
        sf = _pow2(byte - 127)
        # min(sf * 1e30, 1): exact for byte >= 1; byte 0 (sf subnormal) encodes to zeros.
        mask = tl.minimum(sf * _MASK_1E30, 1.0)
        enc = tl.where(byte == 0, 0.0, _pow2(127 - byte) * mask)
        q = _e4m3(xb * enc, HW_CAST)
        sf = tl.where(finite, sf, float("nan"))
        out = tl.reshape(q * tl.broadcast_to(sf, q.shape), (BLOCK_H,))
    elif FMT == 15:
        # flashinfer_nvfp4 on the split tile: BF16 amax, the masked reciprocal, signed zeros.
        finite, a, ds = _bf16_block_decode_scale(x, HW_CAST, SPLIT)
        mask = tl.minimum(ds * _MASK_1E30, 1.0)
        enc = tl.where(ds >= _FLT_MIN, _rcp_approx_bf16_decode_scale(ds, a) * mask, 0.0)
        out = _e2m1_qdq(x, enc, ds, finite, HW_CAST, True)
    elif FMT <= 17:
        # MoRI fp8_blockwise: a block above the FP8 max is scaled by fl(M / a); the others
        # are cast as they are (scale 1).
        FNUZ: tl.constexpr = FMT == 16
        M: tl.constexpr = 240.0 if FNUZ else 448.0
        INV_M: tl.constexpr = _INV_240 if FNUZ else _INV_448
        xb = tl.reshape(x, (BLOCK_H // 128, 128))
        bmax = tl.reduce(tl.abs(xb), 1, _max_nan, keep_dims=True)
        finite = bmax < float("inf")
        a = _round_bf16(tl.where(finite, bmax, 0.0), HW_CAST)
        scaled = a > M
        inv = tl.where(scaled, tl.math.div_rn(tl.full(a.shape, M, tl.float32),
                                              tl.where(scaled, a, 1.0)), 1.0)
        s = tl.where(scaled, a * INV_M, 1.0)
        q = _fp8_element(xb * inv, FNUZ, HW_CAST)
        s = tl.where(finite, s, float("nan"))
        out = tl.reshape(q * tl.broadcast_to(s, q.shape), (BLOCK_H,))
    else:
        # MoRI fp8_direct_cast: each element, SATFINITE; ±inf -> NaN.
        q = _fp8_element(x, FMT == 18, HW_CAST)
        out = tl.where(tl.abs(x) == float("inf"), float("nan"), q)
    return out


@triton.jit
def _tile_cols(BLOCK_H: tl.constexpr, SPLIT: tl.constexpr):
    """This program's columns. ``SPLIT`` (the 16-element block formats): [BLOCK_H // 16, 8],
    the first half of each block (the second half is ``cols + 8``), so that a thread holds
    whole blocks: the block maximum needs no shuffle and each block's scale is computed by
    one thread, once. Otherwise [BLOCK_H]."""
    base = tl.program_id(1) * BLOCK_H
    if SPLIT:
        cols = base + tl.arange(0, BLOCK_H // 16)[:, None] * 16 + tl.arange(0, 8)[None, :]
    else:
        cols = base + tl.arange(0, BLOCK_H)
    return cols


@triton.jit
def _load_tile(ptrs, mask, SPLIT: tl.constexpr, BF16: tl.constexpr, HW_CAST: tl.constexpr):
    """Load the tile at ``ptrs`` (see :func:`_tile_cols`) as FP32; ``SPLIT`` joins the two
    halves of each block into [BLOCK_H // 16, 8, 2] (element ``(b, j, h)`` is column
    ``16 b + 8 h + j``). ``BF16``: the data is BF16 (widened by :func:`_widen_bf16`)."""
    if SPLIT:
        lo = tl.load(ptrs, mask=mask, other=0.0)
        hi = tl.load(ptrs + 8, mask=mask, other=0.0)
        if BF16:
            out = tl.join(_widen_bf16(lo, HW_CAST), _widen_bf16(hi, HW_CAST))
        else:
            out = tl.join(lo.to(tl.float32), hi.to(tl.float32))
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
        if BF16:
            out = _widen_bf16(x, HW_CAST)
        else:
            out = x.to(tl.float32)
    return out


@triton.jit
def _load_raw(ptrs, mask, SPLIT: tl.constexpr):
    """The tile at ``ptrs`` as loaded (BF16, not widened): the two block halves for
    ``SPLIT``, else the tile twice (the same value; no second load)."""
    lo = tl.load(ptrs, mask=mask, other=0.0)
    if SPLIT:
        hi = tl.load(ptrs + 8, mask=mask, other=0.0)
    else:
        hi = lo
    return lo, hi


@triton.jit
def _widen_raw(lo, hi, SPLIT: tl.constexpr, HW_CAST: tl.constexpr):
    """FP32 tile from :func:`_load_raw`'s halves (as :func:`_load_tile` with ``BF16``)."""
    if SPLIT:
        out = tl.join(_widen_bf16(lo, HW_CAST), _widen_bf16(hi, HW_CAST))
    else:
        out = _widen_bf16(lo, HW_CAST)
    return out


@triton.jit
def _store_tile(ptrs, v, mask, SPLIT: tl.constexpr):
    """Store ``v`` (a tile as :func:`_load_tile` returns it) at ``ptrs``."""
    if SPLIT:
        lo, hi = tl.split(v)
        tl.store(ptrs, lo, mask=mask)
        tl.store(ptrs + 8, hi, mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def _tile_mask(mask, SPLIT: tl.constexpr):
    """The load mask in the tile's shape (both halves of a block share it)."""
    if SPLIT:
        out = tl.join(mask, mask)
    else:
        out = mask
    return out


@triton.jit
def _load_amax(amax_ptr, HAS_AMAX: tl.constexpr):
    if HAS_AMAX:
        amax = tl.load(amax_ptr).to(tl.float32)
    else:
        amax = 0.0
    return amax


@triton.jit
def qdq_kernel(
    x_ptr, out_ptr, amax_ptr, H, stride_x, stride_o,
    FMT: tl.constexpr, SPLIT: tl.constexpr, HAS_AMAX: tl.constexpr, BLOCK_H: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """One program per (row, column chunk): ``out[r, chunk] = qdq(x[r, chunk])``.
    ``SPLIT``: whole 16-element blocks per thread (the format row's ``split_tile``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = _tile_cols(BLOCK_H, SPLIT)
    mask = cols < H
    x = _load_tile(x_ptr + row * stride_x + cols, mask, SPLIT,
                   x_ptr.dtype.element_ty == tl.bfloat16, HW_CAST)
    sc = _tensor_consts(_load_amax(amax_ptr, HAS_AMAX), FMT)
    out = _qdq(x, sc, FMT, BLOCK_H, True, SPLIT, HW_CAST)
    if FMT == 0 or out_ptr.dtype.element_ty == tl.bfloat16:
        # ``bf16`` rounds FP32/FP16 input to BF16, as the reference's ``x.to(bfloat16)``.
        out = _round_bf16(out, HW_CAST)
    _store_tile(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask, SPLIT)


@triton.jit
def _accumulate(x, w, sc, acc, raw, cmax, FMT: tl.constexpr,
                WEIGHTED: tl.constexpr, CHECK: tl.constexpr, CALIB: tl.constexpr,
                BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, HW_CAST: tl.constexpr,
                ACC_F32: tl.constexpr):
    """Quantize the row ``x`` and add it (``acc += q`` or, weighted, ``acc = fma(q, w,
    acc)`` with the slot's FP32 weight ``w``); the unquantized sum and the calibration max
    beside it. ``q`` is the dequantized row rounded to BF16 (QDQ, ModelOpt's semantics),
    or with ``ACC_F32`` the FP32 dequantized values as they are (the real FP8/FP4
    combines)."""
    q = _qdq(x, sc, FMT, BLOCK_H, False, SPLIT, HW_CAST)
    if not ACC_F32:
        q = _round_bf16(q, HW_CAST)
    if WEIGHTED:
        w = tl.broadcast_to(w, x.shape)
        acc_new = _fma(q, w, acc, HW_CAST)
        if CHECK:
            raw = _fma(x, w, raw, HW_CAST)
    else:
        acc_new = acc + q
        if CHECK:
            raw = raw + x
    if CALIB:
        cmax = tl.maximum(cmax, tl.abs(x), propagate_nan=_NAN)
    return acc_new, raw, cmax


@triton.jit
def _combine_slot(
    row_base, idx_row, w_row, s, stride_rs, stride_ik, stride_wk, cmask, sc, acc, raw,
    cmax, routed, valid, lo, hi, valid_next, K: tl.constexpr, FMT: tl.constexpr,
    WEIGHTED: tl.constexpr, CHECK: tl.constexpr, CALIB: tl.constexpr,
    BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, HW_CAST: tl.constexpr, ACC_F32: tl.constexpr,
):
    """Routed slot ``s`` of one token (stored at row ``s``), software-pipelined: ``lo, hi``
    hold row ``s`` (loaded one slot ahead), ``valid`` its flag and ``valid_next`` slot
    ``s + 1``'s. First row ``s + 1``'s load and slot ``s + 2``'s flag are issued, then row
    ``s`` is quantized and accumulated while they are in flight. Returns the sums and the
    next slot's ``valid, lo, hi, valid_next``.

    An invalid row is never loaded: it reads as zeros (its weight as 0), which every format
    quantizes to +0.0; adding +0.0 (or ``fma(0, 0, acc)``) leaves the sum's bits as they
    are (the sum starts at +0.0 and so is never -0.0), the unquantized sum's too, and the
    calibration max (>= 0) with it, so no select or branch is needed. (Masks are
    ``where(flag, cmask, False)``: Triton 3.9's interpreter refuses a scalar-and-block
    ``&``.)
    """
    nvalid = valid_next & (s + 1 < K)
    s1 = tl.minimum(s + 1, K - 1)
    lo_n, hi_n = _load_raw(row_base + s1 * stride_rs, tl.where(nvalid, cmask, False), SPLIT)
    s2 = tl.minimum(s + 2, K - 1)
    valid_nn = tl.load(idx_row + s2 * stride_ik) >= 0
    w = 0.0
    if WEIGHTED:
        w = tl.load(w_row + s * stride_wk, mask=valid, other=0.0).to(tl.float32)
    x = _widen_raw(lo, hi, SPLIT, HW_CAST)
    acc, raw, cmax = _accumulate(x, w, sc, acc, raw, cmax, FMT, WEIGHTED, CHECK, CALIB,
                                 BLOCK_H, SPLIT, HW_CAST, ACC_F32)
    routed += valid.to(tl.int32)
    return acc, raw, cmax, routed, nvalid, lo_n, hi_n, valid_nn


@triton.jit
def combine_kernel(
    rows_ptr, idx_ptr, w_ptr, out_ptr, check_ptr, flag_ptr, calib_ptr, amax_ptr,
    H, stride_rs, stride_rt, stride_it, stride_ik, stride_wt, stride_wk, stride_o, stride_c,
    K: tl.constexpr, SHARED: tl.constexpr, FMT: tl.constexpr, SPLIT: tl.constexpr,
    HAS_AMAX: tl.constexpr, WEIGHTED: tl.constexpr, CHECK: tl.constexpr, CALIB: tl.constexpr,
    BLOCK_H: tl.constexpr, HW_CAST: tl.constexpr, UNROLL: tl.constexpr,
    ACC_F32: tl.constexpr,
):
    """One program per (token, column chunk): quantize, re-sum, check, calibrate.

    ``acc`` starts at +0.0 (FP32); the shared row (stored at row ``K``; SHARED, the index of
    the position in ``format_table.SHARED_POSITIONS``: 1 added first, 2 added last) is added
    unquantized in its place (``acc + row``, which is ``fma(row, 1.0, acc)``); each valid
    routed slot (``topk_idx >= 0``) in ascending order adds ``float(bf16(qdq(row)))``
    (``ACC_F32``: the FP32 dequantized row, unrounded), times its router weight with one
    rounding when WEIGHTED; invalid rows are never loaded (read as zeros, or skipped).
    ``SPLIT``: whole 16-element blocks per thread (the format
    row's ``split_tile``).
    """
    t = tl.program_id(0).to(tl.int64)
    cols = _tile_cols(BLOCK_H, SPLIT)
    cmask = cols < H
    # The format's per-tensor constants once, before the slot loop.
    sc = _tensor_consts(_load_amax(amax_ptr, HAS_AMAX), FMT)
    acc = tl.zeros(cols.shape, tl.float32)
    if SPLIT:
        acc = tl.join(acc, acc)
    raw = acc
    cmax = acc
    routed = tl.full((), 0, tl.int32)
    row_base = rows_ptr + t * stride_rt + cols
    idx_row = idx_ptr + t * stride_it
    w_row = w_ptr + t * stride_wt
    if SHARED == 1:
        shared = _load_tile(row_base + K * stride_rs, cmask, SPLIT, True, HW_CAST)
        acc += shared
        raw += shared
    # Slot 0's row and flags before the loop (see _combine_slot's pipelining).
    valid = tl.load(idx_row) >= 0
    lo, hi = _load_raw(row_base, tl.where(valid, cmask, False), SPLIT)
    valid_next = tl.load(idx_row + tl.minimum(1, K - 1) * stride_ik) >= 0
    if not UNROLL:
        # A rolled loop holds one row (and the next) in registers at a time: the heavy
        # formats would spill with every row live (and whole-row programs compile faster).
        # Two slots an iteration: the row loaded ahead alternates between two sets of
        # registers, so no copy moves it into place at the end of each slot.
        for s in range(0, K - 1, 2):
            acc, raw, cmax, routed, valid, lo, hi, valid_next = _combine_slot(
                row_base, idx_row, w_row, s, stride_rs, stride_ik, stride_wk, cmask, sc,
                acc, raw, cmax, routed, valid, lo, hi, valid_next, K, FMT, WEIGHTED, CHECK,
                CALIB, BLOCK_H, SPLIT, HW_CAST, ACC_F32)
            acc, raw, cmax, routed, valid, lo, hi, valid_next = _combine_slot(
                row_base, idx_row, w_row, s + 1, stride_rs, stride_ik, stride_wk, cmask, sc,
                acc, raw, cmax, routed, valid, lo, hi, valid_next, K, FMT, WEIGHTED, CHECK,
                CALIB, BLOCK_H, SPLIT, HW_CAST, ACC_F32)
        if K % 2 == 1:
            acc, raw, cmax, routed, valid, lo, hi, valid_next = _combine_slot(
                row_base, idx_row, w_row, K - 1, stride_rs, stride_ik, stride_wk, cmask, sc,
                acc, raw, cmax, routed, valid, lo, hi, valid_next, K, FMT, WEIGHTED, CHECK,
                CALIB, BLOCK_H, SPLIT, HW_CAST, ACC_F32)
    else:
        for s in tl.static_range(K):
            acc, raw, cmax, routed, valid, lo, hi, valid_next = _combine_slot(
                row_base, idx_row, w_row, s, stride_rs, stride_ik, stride_wk, cmask, sc,
                acc, raw, cmax, routed, valid, lo, hi, valid_next, K, FMT, WEIGHTED, CHECK,
                CALIB, BLOCK_H, SPLIT, HW_CAST, ACC_F32)
    if SHARED == 2:
        shared = _load_tile(row_base + K * stride_rs, cmask, SPLIT, True, HW_CAST)
        acc += shared
        raw += shared
    if CHECK:
        # Read after the slot loop, so no registers hold it across the loop (8-bit formats:
        # 55 -> 40 registers a thread, more programs per SM), and before ``out`` is written
        # (``check_against`` may be ``out`` itself).
        expect = _load_tile(check_ptr + t * stride_c + cols, cmask, SPLIT, True, HW_CAST)
        # BF16 bits compared as the FP32 bits of the widened values (the same comparison).
        got = _round_bf16(raw, HW_CAST).to(tl.int32, bitcast=True)
        # Compared tokens: a routed row, or a fused shared row (every token has one).
        compared = (routed > 0) | (SHARED != 0)
        bad = (got != expect.to(tl.int32, bitcast=True)) & _tile_mask(cmask, SPLIT) & compared
        # Mismatches counted per thread's columns (a 16-block, or 8 columns), then added
        # with a masked atomic (the compiler aggregates a warp's): no block-wide reduction,
        # so no shared memory or barrier. The total added is the same count.
        nbad = bad.to(tl.int32)
        if SPLIT:
            nbad = tl.sum(tl.sum(nbad, 2), 1)
        elif BLOCK_H >= 8:
            nbad = tl.sum(tl.reshape(nbad, (BLOCK_H // 8, 8)), 1)
        else:
            nbad = tl.sum(nbad, 0, keep_dims=True)
        tl.atomic_add(flag_ptr + tl.zeros(nbad.shape, tl.int32), nbad, mask=nbad > 0)
    if CALIB:
        tl.atomic_max(calib_ptr, tl.reduce(cmax, None, _max_nan), mask=routed > 0)
    _store_tile(out_ptr + t * stride_o + cols, _round_bf16(acc, HW_CAST).to(tl.bfloat16), cmask,
                SPLIT)
