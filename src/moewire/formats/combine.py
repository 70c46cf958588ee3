"""The combine wire formats that real Mega-MoE kernels ship, each as its source computes it.

- ``deepgemm_fp8_combine``: DeepGEMM's in-kernel FP8 combine (``DG_USE_FP8_COMBINE=1``),
  read from sgl-deep-gemm 0.2.5 and 0.2.3.post2 (PyPI wheels),
  ``deep_gemm/include/deep_gemm/impls/sm100_fp8_fp4_mega_moe.cuh`` (the L2 epilogue's
  ``kUseFp8Combine`` branch and the combine reduce) and ``common/math.cuh``
  (``fast_log2_ceil``, ``fast_pow2``); the buffer layout in ``layout/mega_moe.cuh``.
- ``trtllm_32e4m3xe8m0`` and ``trtllm_16e2m1xbf16``: TensorRT-LLM's CuteDSL Mega-MoE
  (``MEGAMOE_COMBINE_FORMAT``; the legal values ``bf16``, ``32e4m3xe8m0``, ``16e2m1xbf16`` in
  ``tensorrt_llm/_torch/modules/fused_moe/mega_moe/mega_moe_cute_dsl.py``), whose device
  encoder is not in the sources moewire could read; the math is the kernel package's own
  host oracle, ``combine_roundtrip_to_fp32`` ("quantize then dequantize each block exactly
  as the device combine encoder + topk_reduce do") with ``mxfp8_quantize_per_block_32``
  (``common/host_utils.py``) and ``_pack_f32_to_fp4`` (``moe_nvfp4_swapab/runner_common.py``).
- ``te_mxfp8``: TransformerEngine's cuDNN MoE-EP with ``NVTE_MEGAMOE_MXFP8_COMBINE=1``
  (``transformer_engine/pytorch/ops/fused/moe_ep.py`` only selects ``"mxfp8"`` for
  ``cudnn.moe_ep.MoeEp``, whose kernel source is not public); the math is TE's own MXFP8
  quantizer rule, ``float_to_e8m0`` (``cvt.rp.satfinite.ue8m0x2.f32`` on Blackwell, and its
  bit-level fallback) and ``exp2f_rcp`` in ``transformer_engine/common/util/ptx.cuh``.
- ``flashinfer_mxfp8`` and ``flashinfer_nvfp4``: FlashInfer's Mega-MoE
  (``flashinfer-python`` 0.7.2.post1, ``flashinfer.moe_ep``; ``MegaConfig(megakernel=...)``
  with the kernel config's ``combine_dtype`` ``"mxfp8"`` or ``"nvfp4"``, e.g.
  ``backends/mega/kernel/sm100/nvfp4_nvfp4_bf16_cutedsl/config.py``), read from the device
  encoder the wheel ships: ``kernel_src/sm100/cutedsl_megamoe/shim/nvfp4.py``
  (``COMBINE_FORMAT_NAMES``: ``"mxfp8"`` is ``32e4m3xe8m0``, ``"nvfp4"`` is
  ``16e2m1xbf16``), ``src/src/token_comm.py`` (``CombineFormat``),
  ``src/moe_nvfp4_swapab/epilogue_refactor.py`` (``QuantImpl``: the FC2 epilogue's combine
  encoder) and ``src/moe_nvfp4_swapab/topk_reduce.py`` (the receiver's decode and sum),
  ``src/common/moe_utils.py`` (``cvt_f32_to_f8_to_f32``) and ``common/megamoe_constants.py``.
  The SM107 kernel (``kernel_src/sm107/.../block_scaled_swap_ab_fc12_epilogue.py``) has the
  same encoder. These are the CombineFormat strings of TensorRT-LLM's
  ``MEGAMOE_COMBINE_FORMAT`` too, but the device encoder differs from the host oracle the
  ``trtllm_*`` formats follow (the encoder's reciprocal mask, its ue8m0 rounding, the sign
  of a zero): see each class.

Each of these kernels dequantizes every row into FP32, sums the rows in FP32 and rounds the
sum to BF16 once: ``combine_accumulate = "fp32"`` (``moewire.megamoe.resum``). (FlashInfer's
``topk_reduce`` starts its sum from the first slot's value rather than from +0.0, which
differs from moewire's sum only in the sign of a zero that every slot gives as -0.0.)

Every format here maps a block holding NaN or ±inf to all NaN: the sources leave that case
open (DeepGEMM's amax is a ``cute::max`` shuffle whose NaN result depends on lane order, the
host oracles' integer cast of a NaN exponent is undefined), and a healthy model's combine
rows are finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire.formats._block_combine import BlockCombineFormat
from moewire.formats._numerics import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_magnitude,
    e4m3,
    exponent_fields,
    mul_recip,
    pow2,
    rcp_approx_bf16_decode_scale,
)
from moewire.formats.base import register

# TensorRT-LLM's host oracle clamps the block amax to this before the scale (FP32 value).
_TRTLLM_AMAX_FLOOR = 1e-30
# FlashInfer's encoders mask their reciprocal with min(scale * 1e30, 1) (cutlass.Float32(1e30),
# the FP32 value nearest 1e30) so that a zero scale gives a zero reciprocal, not inf.
_FLASHINFER_MASK = 1e30


def _ue8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """``cvt.rp.satfinite.ue8m0x2.f32`` of FP32 ``v >= 0``: the E8M0 byte (int32) of the
    smallest power of two ``2^(byte - 127) >= v``, ``2^-127 .. 2^127``; ``+inf`` saturates to
    byte 254 like every ``v > 2^127``.

    From the bits: a normal ``v`` gives its biased exponent, plus one when the mantissa is
    non-zero, at most 254 (saturating); a subnormal ``v`` rounds up to ``2^-127`` (byte 0)
    when ``v <= 2^-127`` and to ``2^-126`` (byte 1) above; 0 gives byte 0.
    """
    import torch

    biased, inexact = exponent_fields(v)
    mantissa = v.view(torch.int32) & 0x7FFFFF
    subnormal_byte = (mantissa > 0x400000).to(torch.int32)
    return torch.where(biased == 0, subnormal_byte, (biased + inexact).clamp(max=254))


class DeepGEMMFP8Combine(BlockCombineFormat):
    """``deepgemm_fp8_combine``: DeepGEMM's ``DG_USE_FP8_COMBINE=1`` wire, E4M3 with one UE8M0
    scale per (token, slot, 128 columns).

    Math per block ``b`` of 128 columns, FP32 (``fl`` = one FP32 rounding)::

        amax = max|x_b|                               # no floor (a zero block has amax 0)
        s    = fl(amax * fl(1/448))                   # `local_amax * (1.0f / 448.0f)`
        e    = E(s) - 127 + (M(s) != 0)               # fast_log2_ceil: E, M the exponent
                                                      # and mantissa fields of s
        q    = e4m3(fl(x_b * 2^-e))                   # __nv_fp8x4_e4m3: RNE, satfinite
        sf   = 0 if e == -127 else 2^e                # fast_pow2(byte - 127); byte = e + 127
        out  = q * sf                                 # exact (a power of two)

    ``e`` is ``ceil(log2 s)`` for a normal ``s``; a subnormal ``s`` gets ``-126`` and
    ``s = 0`` (a zero block, or an FP32 amax below ``2^-140``) gets ``-127``, whose
    dequantization scale ``fast_pow2(-127)`` is the bit pattern 0, i.e. ``0.0``: such a
    block comes out as zeros. ``fl(x_b * 2^-e)`` never exceeds 448, so the saturation
    never fires on finite input.

    How it differs from ``fp8_b128_ue8m0`` (DeepGEMM's host cast ``per_token_cast_to_fp8``):
    that one floors the block amax at ``1e-4`` first, so a block with ``amax < 1e-4``
    gets a coarser scale there (``2^-22``) and loses its small values; above the floor the
    two agree (``tests/formats/test_combine_formats.py`` shows both cases).

    The combine reduce reads the FP8 bytes and the scale byte, and accumulates
    ``acc = fma(float(q), sf, acc)`` in FP32 in ascending slot order, then rounds to BF16
    once (``__float22bfloat162_rn``); ``fma`` with an exact product is one addition.
    """

    name = "deepgemm_fp8_combine"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        s = mul_recip(block_amax, E4M3_MAX)
        biased, inexact = exponent_fields(s)
        e = biased - 127 + inexact
        q = e4m3(xb * pow2(-e))
        sf = torch.where(e == -127, torch.zeros_like(s), pow2(e))
        return q * sf


class TRTLLMMXFP8Combine(BlockCombineFormat):
    """``trtllm_32e4m3xe8m0``: TensorRT-LLM's ``MEGAMOE_COMBINE_FORMAT=32e4m3xe8m0``, E4M3
    with one E8M0 scale per 32 columns, the scale rounded up.

    Math per block ``b`` of 32 columns, FP32 (the host oracle's
    ``mxfp8_quantize_per_block_32``)::

        amax = max|x_b|
        s    = fl(max(amax, fl(1e-30)) * fl(1/448))  # torch.clamp(min=1e-30) * Fp8E4M3RcpLimit
        e    = clamp(ceil(log2 s), -127, 127)        # exact, from the bits of s
        e    = -127 if amax == 0                     # E8M0 byte 0
        q    = e4m3(x_b / 2^e)                       # exact division, RNE
        out  = q * 2^e

    The oracle writes ``ceil(torch.log2(s))``; moewire takes the exact ``ceil(log2 s)``
    from the exponent bits (as the device's UE8M0 conversion does). The two differ only
    where ``torch.log2`` rounds a value just above a power of two down onto it.

    How it differs from moewire's ``mxfp8`` (the OCP rule ``2^(floor(log2 amax) - 8)``):
    the ceiling never lets the block maximum exceed 448, while OCP's floor lets it
    saturate, and the two scales differ by one binade for most blocks; from ``te_mxfp8``
    only for a block amax below ``1e-30`` (the floor here, none there). The top-k sum runs
    in the op, after the kernel, in FP32 (TopkReduce "form A"; quantized combine formats
    refuse the in-kernel "form B" reduce), with one BF16 rounding.
    """

    name = "trtllm_32e4m3xe8m0"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        floor = torch.tensor(_TRTLLM_AMAX_FLOOR, dtype=torch.float32)
        s = mul_recip(torch.maximum(block_amax, floor.to(block_amax.device)), E4M3_MAX)
        biased, inexact = exponent_fields(s)
        e = (biased - 127 + inexact).clamp(-127, 127)
        e = torch.where(block_amax == 0, torch.full_like(e, -127), e)
        q = e4m3(xb * pow2(-e))
        return q * pow2(e)


class TEMXFP8Combine(BlockCombineFormat):
    """``te_mxfp8``: TransformerEngine's MXFP8 rule (``NVTE_MEGAMOE_MXFP8_COMBINE=1``), E4M3
    with one E8M0 scale per 32 columns, rounded up.

    Math per block ``b`` of 32 columns, FP32 (``float_to_e8m0``, ``exp2f_rcp``)::

        amax = max|x_b|
        v    = fl(amax * fl(1/448))                  # amax * max_norm_rcp
        byte = 0                if v == 0            # cvt.rp.satfinite.ue8m0x2.f32:
             = 0 or 1           if v is subnormal    #   round up to a power of two,
                                                     #   0 up to 2^-127, 1 above
             = min(E(v) + (M(v) != 0), 254) else     #   saturating at 2^127
        r    = 1 if byte == 0 else 2^(127 - byte)    # exp2f_rcp
        q    = e4m3(fl(x_b * r))
        out  = q * 2^(byte - 127)

    A block with ``byte = 0`` (``amax <= 448 * 2^-127``) is quantized with ``r = 1``, so all
    of its values round to zero. Everywhere else this is ``trtllm_32e4m3xe8m0``'s math;
    they differ only for blocks with ``amax < 1e-30`` (tests show one).
    """

    name = "te_mxfp8"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        v = mul_recip(block_amax, E4M3_MAX)
        byte = _ue8m0_round_up(v)
        recip = torch.where(byte == 0, torch.ones_like(v), pow2(127 - byte))
        q = e4m3(xb * recip)
        return q * pow2(byte - 127)


class TRTLLMFP4Combine(BlockCombineFormat):
    """``trtllm_16e2m1xbf16``: TensorRT-LLM's ``MEGAMOE_COMBINE_FORMAT=16e2m1xbf16``, E2M1
    with one BF16 value per 16 columns (the block amax; the scale is derived from it).

    Math per block ``b`` of 16 columns, FP32 (the host oracle ``combine_roundtrip_to_fp32``)::

        a    = bf16(max|x_b|)                        # stored as BF16 (exact for BF16 rows)
        ds   = fl(a * fl(1/6))                       # decode scale, * Nvfp4E2M1RcpLimit
        enc  = fl(1 / ds) if ds >= 2^-126 else 0     # the encoder's reciprocal; its
                                                     # .ftz flushes a subnormal ds
        q    = e2m1(fl(x_b * enc))                   # nearest, ties to even, saturating
                                                     # at 6; a zero result is +0.0
        out  = fl(q * ds)                            # "plain unpack * stored_scale"

    ``q * ds`` needs up to 26 significant bits, so the dequantized value is an FP32 number
    that BF16 cannot hold: the kernel's FP32 accumulation and a QDQ-to-BF16 sum differ
    here (``moewire.megamoe.resum``'s two accumulation modes).

    Not modelled: the device encoder takes ``enc`` with ``rcp.approx.ftz.f32``, which may
    differ from the correctly rounded reciprocal by one ulp (an element within an ulp of
    an E2M1 rounding midpoint can then round the other way). Its ``.ftz`` flushes a
    subnormal ``ds`` (``a < 6 * 2^-126``) to zero, and moewire encodes such a block as
    zeros, as for ``ds = 0`` (the host oracle's ``0 * inf`` would give NaN for a zero
    element, from a finite input). The oracle's nearest-value table lists the
    even-mantissa values and +0 first, which is what makes its ties go to even and its
    zeros positive.
    """

    name = "trtllm_16e2m1xbf16"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        ds = mul_recip(block_amax.to(torch.bfloat16).to(torch.float32), E2M1_MAX)
        normal = ds >= torch.finfo(torch.float32).tiny
        enc = torch.where(normal, torch.reciprocal(ds), torch.zeros_like(ds))
        v = xb * enc
        mag = e2m1_magnitude(v.abs().clamp(max=E2M1_MAX))
        q = torch.where(mag == 0, torch.zeros_like(mag), torch.copysign(mag, v))
        return q * ds


class FlashInferMXFP8Combine(BlockCombineFormat):
    """``flashinfer_mxfp8``: FlashInfer's Mega-MoE combine with ``combine_dtype="mxfp8"``
    (CombineFormat ``32e4m3xe8m0``), E4M3 with one E8M0 scale per 32 columns, rounded up.

    Math per block ``b`` of 32 columns, FP32 (``QuantImpl._e8m0`` and ``_enc_mxfp8`` in
    ``epilogue_refactor.py``; ``fl`` = one FP32 rounding)::

        a    = bf16(max|x_b|)                       # _amax_thread_bf16: the packed BF16
                                                    # abs-max (exact for BF16 rows)
        c    = fl(a * fl(1/448))                    # amax * Fp8E4M3RcpLimit
        byte = ue8m0_round_up(c)                    # cvt.rp.satfinite.ue8m0x2.f32: the
                                                    # smallest 2^(byte-127) >= c, 0 -> 0
        sf   = 2^(byte - 127)                       # cvt.rn.bf16x2.ue8m0x2, exact
        enc  = min(rcp(sf), FP32_MAX) * min(fl(sf * fl(1e30)), 1)      # _enc_mxfp8
             = 2^(127 - byte)   if byte >= 28       # the mask is 1
             = fl(1e30)         if 1 <= byte <= 27  # sf < 2^-99.66: the mask is sf * 1e30
                                                    # (exact), and rcp(sf) * that is 1e30
             (byte 0: see below)
        q    = e4m3(fl(x_b * enc))                  # .to(Float8E4M3FN): RNE, satfinite
        out  = q * sf                               # topk_reduce: fmul(value, scale), exact

    The mask is there so that a zero scale encodes to zero rather than ``0 * inf``; it also
    fires for every tiny block, ``a <= 448 * 2^-100`` (about 3.5e-28, bytes 1 to 27), whose
    elements are then multiplied by ``1e30`` instead of ``1 / sf``, i.e. by ``sf * 1e30``
    too little (0.79 at byte 27, 0.39 at byte 26, halving with each byte below): they
    come back that much smaller (``q * sf``, with ``q`` of the shrunk value), and at byte
    8 and below (``a <= 448 * 2^-119``) as zeros.
    Byte 0 (``a <= 448 * 2^-127``): ``sf = 2^-127`` is an FP32 subnormal, which
    ``rcp.approx.ftz`` flushes, so ``enc`` is ``FP32_MAX * fl(2^-127 * 1e30)`` (about 2e30;
    0 if the multiply flushed too) and every ``x_b * enc`` is below E4M3's smallest half
    step: the block comes back as zeros with the signs of ``x_b``. moewire takes
    ``enc = 0`` there, which gives the same bits.

    ``rcp`` is ``rcp.approx.ftz.f32``; on a power of two it is exact (``2^-e``), which is
    the only input it gets here. The scale rule is ``te_mxfp8``'s (``cvt.rp`` to UE8M0 of
    ``amax * fl(1/448)``); the two formats differ in the mask (blocks with ``a <= 448 *
    2^-100``) and in reading the block amax as BF16 (FP32/FP16 input only). The kernel
    package's host oracle, which ``trtllm_32e4m3xe8m0`` follows, has no mask (it floors the
    amax at 1e-30 instead): it parts from this format in the same tiny blocks. Assumed, not
    read: that the CuTe DSL compiles
    ``amax * Fp8E4M3RcpLimit`` without flushing subnormals (else blocks with ``448 * 2^-127
    < a < 448 * 2^-126`` would come back as zeros instead of byte 1).

    The receiver (``TopkReduce._reduce_mxfp8``) decodes ``float(q) * sf`` and adds the
    slots in FP32 in top-k order, one BF16 rounding at the end.
    """

    name = "flashinfer_mxfp8"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        c = mul_recip(block_amax.to(torch.bfloat16).to(torch.float32), E4M3_MAX)
        byte = _ue8m0_round_up(c)
        sf = pow2(byte - 127)
        mask = (sf * torch.tensor(_FLASHINFER_MASK, dtype=torch.float32)).clamp(max=1.0)
        enc = torch.where(byte == 0, torch.zeros_like(sf), pow2(127 - byte) * mask)
        return e4m3(xb * enc) * sf


class FlashInferNVFP4Combine(BlockCombineFormat):
    """``flashinfer_nvfp4``: FlashInfer's Mega-MoE combine with ``combine_dtype="nvfp4"``
    (CombineFormat ``16e2m1xbf16``), E2M1 with one BF16 block amax per 16 columns.

    Math per block ``b`` of 16 columns, FP32 (``QuantImpl.nvfp4_combine_quant_*`` and
    ``_enc_nvfp4`` in ``epilogue_refactor.py``, ``TopkReduce._reduce_fp4``)::

        a    = bf16(max|x_b|)                       # stored as the block's scale (BF16)
        ds   = fl(a * fl(1/6))                      # decode scale, * Nvfp4E2M1RcpLimit;
                                                    # the receiver recomputes the same
        enc  = fl(min(rcp(ds), FP32_MAX) * min(fl(ds * fl(1e30)), 1))  # _enc_nvfp4
             = 0 if ds < 2^-126                     # rcp.approx.ftz flushes a subnormal ds
                                                    # (then every x_b * enc rounds to 0)
        q    = e2m1(fl(x_b * enc))                  # .to(Float4E2M1FN): RNE, saturating at
                                                    # 6, sign kept (a -0.0 is possible)
        out  = fl(q * ds)                           # topk_reduce: fmul(value, scale)

    For ``ds >= fl(1e30)^-1`` (``a >= 6e-30``, about) the mask is 1 and ``enc`` is the
    reciprocal; below it ``enc`` is close to ``1e30`` instead of ``1 / ds``, so a tiny
    block's elements are encoded too small (0.5 of their value at ``a = 3e-30``), and come
    back that much smaller. ``q * ds`` needs up to 26 significant bits, so the dequantized
    value is FP32 that BF16 cannot hold (the FP32 accumulation and a QDQ-to-BF16 sum differ,
    as for ``trtllm_16e2m1xbf16``).

    ``rcp`` is ``rcp.approx.ftz.f32``, as on the device (the kernel package's own oracle
    calls the same instruction through Triton, ``_rcp_approx_ftz_f32_cuda``), modelled
    bit for bit: PTX allows the approximation one ulp of error, and one ulp matters, since
    BF16 rows put many elements exactly on an E2M1 midpoint of ``x / ds`` (``x = 5a/12`` is
    a BF16 value whenever ``a``'s significand is a multiple of 3), where the last bit of
    ``enc`` decides the rounding. ``ds`` takes one significand per BF16 significand of ``a``
    (128), and the instruction's result depends on the significand of ``ds`` alone, so the
    model is the correctly rounded reciprocal moved by one ulp at 16 of them
    (``_numerics.rcp_approx_bf16_decode_scale``). Measured on an H100 (Hopper's MUFU:
    4024 of the 32512 positive normal BF16 amaxes get a reciprocal one ulp off the
    correctly rounded one, and 2926 (amax, BF16 element) pairs a different E2M1 code);
    ``tests/formats/test_flashinfer_rcp.py`` checks the model against that measurement on
    every BF16 amax. Assumed, not measured: that Blackwell's MUFU, where the kernel runs,
    gives the same results; and that the E2M1 convert keeps the sign of a value that
    rounds to zero (IEEE's rule; the host oracle's table writes +0.0).

    How it differs from ``trtllm_16e2m1xbf16`` (the kernel package's host oracle, with the
    correctly rounded reciprocal): the device's reciprocal, the mask (blocks with ``a``
    below about 6e-30) and the sign of a zero.
    """

    name = "flashinfer_nvfp4"

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        a = block_amax.to(torch.bfloat16).to(torch.float32)
        ds = mul_recip(a, E2M1_MAX)
        mask = (ds * torch.tensor(_FLASHINFER_MASK, dtype=torch.float32)).clamp(max=1.0)
        normal = ds >= torch.finfo(torch.float32).tiny
        rcp = rcp_approx_bf16_decode_scale(ds, a)
        enc = torch.where(normal, rcp * mask, torch.zeros_like(ds))
        v = xb * enc
        q = torch.copysign(e2m1_magnitude(v.abs().clamp(max=E2M1_MAX)), v)
        return q * ds


register(DeepGEMMFP8Combine)
register(TRTLLMMXFP8Combine)
register(TEMXFP8Combine)
register(TRTLLMFP4Combine)
register(FlashInferMXFP8Combine)
register(FlashInferNVFP4Combine)
