"""AMD's low-precision combines: MoRI's FP8 combine modes, as vLLM's MoRI backend selects them.

vLLM's MoRI prepare/finalize leaves the combine's quantization to MoRI: its ``CombineDtype``
``fp8`` and ``fp8_direct_cast`` map to MoRI's ``EpDispatchCombineConfig.quant_type``
``"fp8_blockwise"`` and ``"fp8_direct_cast"`` (``combine_dtype_to_mori_quant_type`` in
``vllm/model_executor/layers/fused_moe/prepare_finalize/mori.py``; ``combine_quant_type`` in
``prepare_finalize/mori_dtypes.py`` at vLLM commit 4be1f46, where MXFP4 weights select the
``fp8`` combine by default and ``VLLM_ROCM_MORI_COMBINE_DTYPE`` overrides it).

The kernels were read in ROCm/mori at commit 624002c (2026-08-21):
``include/mori/core/transport/p2p/device_primitives.hpp`` (``WarpQuantizeToFp8Blockwise``,
``detail::WarpQuantizeBf16ToFp8BlockwiseVec``, ``detail::Bf16AbsBits``,
``CvtFloat2ToFp8x2``, ``WarpCastBf16ToCombineInternalFp8``, and the receivers
``WarpAccumFp8DequantFull`` / ``AccumFp8Packed4`` and ``WarpAccumCombineInternalFp8ToBf16``),
``src/ops/dispatch_combine/intranode.hpp`` (which helper each mode calls),
``src/ops/dispatch_combine/dispatch_combine.cpp`` (the block count) and
``include/mori/utils/data_types.hpp`` (the FP8 type). The FP8 type is the GPU's:
``MORI_FP8_TYPE_FNUZ_ENABLED`` (E4M3 FNUZ, max 240) where HIP's ``amd_hip_fp8.h`` sets
``HIP_FP8_TYPE_FNUZ``, on gfx942 (MI300X, MI325X); ``MORI_FP8_TYPE_OCP_ENABLED`` (OCP E4M3,
max 448) on gfx950 (MI350X, MI355X). Each mode is one format per FP8 type: ``_fnuz`` and
``_ocp``.

The receiver adds each slot's dequantized row in FP32 from +0.0, in slot order, and rounds
the sum to BF16 once (``__float22bfloat162_rn``): ``combine_accumulate = "fp32"``. One
difference is not modelled by ``moewire.megamoe.resum``: the blockwise receiver adds a
scaled block with ``fmaf(q, s, acc)``, one rounding, where moewire adds the rounded
``fl(q * s)``; the two sums can differ in their last FP32 bit (and then, rarely, in the
BF16 result) for blocks whose amax exceeds the FP8 maximum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire import format_table
from moewire.formats._block_combine import BlockCombineFormat
from moewire.formats._numerics import fp8_element, mul_recip
from moewire.formats.base import WireFormat, register


class MoRIFP8Blockwise(BlockCombineFormat):
    """MoRI's ``fp8_blockwise`` combine (vLLM ``CombineDtype.fp8``): FP8 with one FP32 scale
    per block of 128 columns, used only to scale a block *down* when it would overflow.

    ``M`` is the FP8 type's largest value: 240 (``mori_fp8_blockwise_fnuz``, MI300) or 448
    (``mori_fp8_blockwise_ocp``, MI355). Math per block ``b``, FP32 (``fl`` = one FP32
    rounding; ``WarpQuantizeBf16ToFp8BlockwiseVec``)::

        a    = bf16(max|x_b|)                 # the row's BF16 bits compared as integers
        if a > M:                             # sbScaled
            inv = fl(M / a)                   # fp8Max / maxAbs: a true division
            s   = fl(a * fl(1/M))             # maxAbs * invFp8Max: the FP32 scale sent
            q   = fp8(fl(x_b * inv))
            out = fl(q * s)                   # the receiver: fmaf(q, s, acc)
        else:                                 # invScale = 1, scale 1: a direct cast
            out = fp8(x_b)
        fp8(v) = RNE(clamp(v, -M, M))         # CvtFloat2ToFp8x2: fmed3f clamp, then
                                              # __builtin_amdgcn_cvt_pk_fp8_f32

    So a block within the FP8 range is cast as it is, and its small values fall into FP8's
    subnormals (step 2^-10 for FNUZ, 2^-9 for OCP) or to zero; only an overflowing block
    gets a scale. The FNUZ element has no negative zero (a negative value that rounds to
    zero is +0.0); OCP E4M3 keeps the sign. The sender flags a token with a scaled block
    by negating its first scale, and the receiver takes its absolute value: no effect on
    the values. HIP's FP32 division is correctly rounded by default (MoRI's JIT compiles
    with ``-O2`` and no fast-math flags).

    Block size: MoRI's block is ``ceil(H / MORI_FP8_COMBINE_SCALE_DIM)`` columns, the scale
    dim 56 by default (``kDefaultFp8BlockwiseScaleDim``): 128 columns for H = 7168, the
    hidden size of DeepSeek-V3/R1 and Kimi-K2, which this format fixes. For another hidden
    size MoRI's default block differs (H = 4096: 74 columns, the last block shorter); set
    ``MORI_FP8_COMBINE_SCALE_DIM = H / 128`` there to get this format.

    NaN and ±inf: MoRI's amax ignores NaN (``Bf16AbsBits``) and an infinite amax scales the
    block by ``M / inf = 0`` with ``s = inf``, so that block decodes to NaN; moewire makes
    any block holding NaN or ±inf all NaN (:class:`BlockCombineFormat`).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # M and the FP8 cast of the row's element (E4M3 FNUZ or OCP E4M3).
        self._max, self._cast = fp8_element(format_table.facts(name).element)

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        import torch

        a = block_amax.to(torch.bfloat16).to(torch.float32)
        scaled = a > self._max
        safe = torch.where(scaled, a, torch.ones_like(a))
        inv = torch.where(scaled, torch.full_like(a, self._max) / safe, torch.ones_like(a))
        s = torch.where(scaled, mul_recip(a, self._max), torch.ones_like(a))
        return self._cast(xb * inv) * s


class MoRIFP8DirectCast(WireFormat):
    """MoRI's ``fp8_direct_cast`` combine (vLLM ``CombineDtype.fp8_direct_cast``): every
    element cast to FP8, no scale.

    ``M`` as for :class:`MoRIFP8Blockwise`: 240 (``mori_fp8_direct_cast_fnuz``, MI300) or
    448 (``mori_fp8_direct_cast_ocp``, MI355). Math per element, FP32
    (``WarpCastBf16ToCombineInternalFp8``: ``__hip_cvt_bfloat16raw2_to_fp8x2`` with the type's
    default ``__HIP_SATFINITE``)::

        out = RNE(clamp(x, -M, M))            # NaN, +inf, -inf -> NaN

    SATFINITE clamps finite values only ("propagate NAN/INF, no clipping"), and neither FP8
    type has an infinity: the convert makes ±inf NaN, as ``cast_to_f8`` (the header's
    software path) does. The FNUZ element has no negative zero (-0.0 and a negative value
    that rounds to zero give +0.0). The receiver (``WarpAccumCombineInternalFp8ToBf16``)
    widens each FP8 value (exact) and adds the slots in FP32 from +0.0.

    Not modelled: in ROCm/clr's ``amd_hip_fp8.h`` (``hipamd/include/hip/amd_detail``, read at
    commit 00387053), the packed device path that MoRI's 8-element loop takes,
    ``cast_to_f8x2_from_f32x2``, clamps a copy of its inputs and then converts the
    unclamped ones, so a finite value beyond ``±M`` meets the hardware convert's own
    out-of-range rule there (moewire saturates it, as the scalar path and SATFINITE say).
    Combine rows within ``±M`` are unaffected.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._max, self._cast = fp8_element(format_table.facts(name).element)

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        v = x.to(torch.float32)
        q = self._cast(v)
        return torch.where(torch.isinf(v), torch.full_like(q, float("nan")), q).to(x.dtype)


register(MoRIFP8Blockwise("mori_fp8_blockwise_fnuz"))
register(MoRIFP8Blockwise("mori_fp8_blockwise_ocp"))
register(MoRIFP8DirectCast("mori_fp8_direct_cast_fnuz"))
register(MoRIFP8DirectCast("mori_fp8_direct_cast_ocp"))
