"""AMD's Mega-MoE combine: FlyDSL's ``fp8_blockwise_1x32`` stage-2 transport.

AMD's fused Mega-MoE (``MegaMoEV2``: FlyDSL's ``kernels/mega_moe/``, vendored in aiter as
``aiter.ops.flydsl.kernels.mega_moe``; SGLang 0.5.23 runs it from
``sglang/srt/layers/moe/mega_moe_flydsl.py``) sends each (token, slot) row of the second
GEMM to the token's rank either as BF16 (``p2p_quant="none"``) or as ``fp8_blockwise_1x32``:
the router-weighted row cast to FP8 with one E8M0 byte per 32 columns, stored peer to peer,
dequantized by the combine, the slots added in FP32. aiter's ``select_mega_moe_config``
(``mega_moe_config.py``) picks ``fp8_blockwise_1x32`` when the capacity per rank
(``max_tok_per_rank``, SGLang's ``SGLANG_AMD_FLYDSL_MEGA_MOE_MTPR``) is above
``P2P_FP8_MIN_MTPR = 1024``, and ``"none"`` at or below it; A8W4 and A4W4 alike.

Read in ROCm/FlyDSL at 11c4174d (2026-08-21), whose files are named here, and in
ROCm/aiter at e4048607a5 (2026-08-22), which has the same code under
``aiter/ops/flydsl/kernels/``: ``kernels/mega_moe/mega_moe_stage2.py``
(``_fp8_scale_for_leader`` and ``p2p_scatter_epilog``: the sender),
``kernels/comm/flydsl_dispatch_combine_intranode_kernel.py`` (``make_combine_jit`` with
``blockwise_fp8_transport``: the receiver's stage 3), ``kernels/mega_moe/mega_moe_config.py``
(the selection), and ``kernels/mega_moe/quant.py``, whose MXFP4 cast hands
``cvt_scalef32_pk_fp4_f32`` the same dequantization scale: the scaled converts divide by
their scale (MLIR's ``arith.scaling_truncf``, which lowers to them, is ``truncf(x /
scale)``).

FNUZ or OCP: the source has one FP8 type. ``compile_mega_moe_stage2`` (and stage 1) refuse
any GPU but CDNA4 (``gfx95x``: MI350X, MI355X), and the sender's convert
``v_cvt_scalef32_pk_fp8_f32`` and the receiver's ``v_cvt_pk_f32_fp8`` are gfx950's, on OCP
E4M3 (max 448). There is no MI300 (gfx942, E4M3 FNUZ) path to model, so one format, OCP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire.formats._block_combine import BlockCombineFormat
from moewire.formats._numerics import E4M3_MAX, e4m3, exponent_fields, mul_recip, pow2
from moewire.formats.base import get, register

__all__ = ["FlyDSLFP8Blockwise1x32", "transport"]


class FlyDSLFP8Blockwise1x32(BlockCombineFormat):
    """``flydsl_fp8_blockwise_1x32``: FlyDSL's ``p2p_quant="fp8_blockwise_1x32"``, OCP E4M3
    with one E8M0 byte per 32 columns, the scale rounded up.

    Math per block ``b`` of 32 columns of a router-weighted row ``x`` (FP32; ``fl`` = one
    FP32 rounding; ``E``, ``M`` the exponent and mantissa fields)::

        amax = max|x_b|                             # maximumf of fabs over 4 lanes x 8
        w    = fl(amax * fl(1/448))                 # local_max * 0x3B124925
        byte = 0                   if w == 0        # (amax == 0 -> 0, and an underflow)
             = E(w) + (M(w) != 0)  else             # a subnormal w gives byte 1
        q    = e4m3(x_b / 2^(byte - 127))           # cvt_scalef32_pk_fp8_f32: RNE, OCP
        sf   = bits(byte << 23)                     # the receiver's float: 2^(byte - 127),
                                                    # and +0.0 for byte 0
        out  = q * sf                               # exact (a power of two, or zero)

    ``byte`` is ``127 + ceil(log2 w)`` for a normal ``w``: ``amax / 2^(byte - 127)`` is at
    most 448 (``fl(1/448)`` rounds up; every FP32 amax of a binade checked), so the
    convert's saturation never fires on finite input. The source clamps ``byte`` at 255,
    which only a NaN or infinite amax reaches.

    Byte 0 (``amax`` 0, or below ``448 * 2^-150`` where ``w`` underflows): the receiver
    multiplies by +0.0, so the block comes back as zeros with the signs of ``x_b``. The
    sender converts with a scale whose float is +0.0; moewire takes the convert to read
    only its exponent field, E8M0 byte 0 (``2^-127``, as MI355's scaled converts read the
    scale), under which every such ``x_b`` rounds to a signed zero too: read, not run.

    How it differs from its neighbours: ``deepgemm_fp8_combine`` has the same rule on
    128-column blocks; ``te_mxfp8`` rounds a subnormal ``w <= 2^-127`` to byte 0 and then
    quantizes with 1 (its blocks with ``amax <= 448 * 2^-127`` come back as zeros, here they
    keep their values with byte 1); ``trtllm_32e4m3xe8m0`` floors the amax at ``1e-30``;
    ``flashinfer_mxfp8`` reads the amax as BF16 and masks tiny blocks; ``mxfp8`` (OCP's
    ``floor(log2 amax) - 8``) lets the block maximum saturate and takes a scale one binade
    lower for most blocks.

    The sender's input is FP32: ``x = fl(acc * w)``, the second GEMM's FP32 accumulator
    (the CShuffle slab, ``g2_bf16_lds=False`` is required) times the slot's FP32 router
    weight, one rounding, before the amax and the cast. A row that a host stages in BF16
    first is one rounding more than the kernel makes (it can change the amax's binade);
    quantize the FP32 product to be bit for bit. :func:`transport` is the whole path.

    The receiver (``blockwise_fp8_transport`` in the combine's stage 3) decodes each FP8
    value exactly (``cvt_pk_f32_fp8``), adds ``q * sf`` for slots ``0 .. k-1`` in order to an
    FP32 accumulator that starts at +0.0, and rounds the sum to BF16 once (``truncf``,
    RNE): ``combine_accumulate = "fp32"`` with router-weighted rows.

    Assumed, not read (the CDNA4 ISA pages of the converts were not at hand): the scaled
    convert rounds to nearest even, as the default round mode does, and FP32 subnormals are
    kept (the source sets no denormal mode). Saturation would not matter: no finite block
    reaches it under this scale.

    NaN and ±inf: the source's amax propagates NaN (``maximumf``), the byte is 255 and the
    receiver's scale +inf, so every element decodes to NaN (``0 * inf``, ``inf / inf``):
    the whole block NaN, moewire's rule for every block combine.
    """

    name = "flydsl_fp8_blockwise_1x32"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        biased, inexact = exponent_fields(mul_recip(block_amax, E4M3_MAX))
        byte = biased + inexact
        q = e4m3(xb * pow2(127 - byte))
        return q * (byte << 23).view(torch.float32)


register(FlyDSLFP8Blockwise1x32)


def transport(acc: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The ``fp8_blockwise_1x32`` combine of whole tokens, as the kernel computes it.

    ``y[t] = bf16(sum_{s = 0 .. k-1} qdq(fl(acc[t, s] * weights[t, s])))``: each slot's row
    weighted in FP32 (one rounding), quantized and dequantized by
    :class:`FlyDSLFP8Blockwise1x32` (FP32 values), the slots added in FP32 from +0.0 in
    ascending order, one BF16 rounding (RNE). Every slot is summed: the receiver reads the
    ``k`` rows of each token without a validity mask (a slot the kernel skips must hold a
    zero row, which moewire's ``resum`` gets by selecting it away).

    Args:
        acc: FP32 ``[T, k, H]``, the second GEMM's accumulator row of each (token, slot).
        weights: FP32 ``[T, k]``, the router weights.

    Returns:
        BF16 ``[T, H]``.

    Raises:
        ValueError: ``acc`` or ``weights`` is not FP32, or their shapes do not match.
    """
    import torch

    if acc.dtype != torch.float32 or weights.dtype != torch.float32:
        raise ValueError(
            f"flydsl.transport: acc and weights must be float32 (the kernel weights the FP32 "
            f"accumulator), got {acc.dtype} and {weights.dtype}; pass acc.float() and "
            "weights.float()"
        )
    if acc.dim() != 3 or tuple(weights.shape) != tuple(acc.shape[:2]):
        raise ValueError(
            f"flydsl.transport: acc must be [T, k, H] and weights [T, k], got "
            f"{tuple(acc.shape)} and {tuple(weights.shape)}; one weight per (token, slot)"
        )
    rows = get(FlyDSLFP8Blockwise1x32.name).dequantize(acc * weights.unsqueeze(-1))
    total = torch.zeros_like(rows[:, 0])
    for s in range(rows.shape[1]):
        total = total + rows[:, s]
    return total.to(torch.bfloat16)
