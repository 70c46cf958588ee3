"""FP8 E4M3 wire formats: per tensor (ModelOpt) and per block (DeepGEMM, DeepEP), and the
per-tensor format in MI300's FP8 type, E4M3 FNUZ.

E4M3 ("fn"): 1 sign, 4 exponent, 3 mantissa bits, max 448, no inf. Every E4M3 cast here is
``e4m3(v) = RNE(clamp(v, -448, 448))`` (see :func:`moewire.formats._numerics.e4m3`).
E4M3 FNUZ: the same bits with exponent bias 8, max 240, no inf and no negative zero
(:func:`moewire.formats._numerics.e4m3fnuz`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire import format_table
from moewire.formats._numerics import (
    E4M3_MAX,
    ceil_pow2_ue8m0,
    e4m3,
    fp8_element,
    mul_recip,
    split_blocks,
)
from moewire.formats.base import ModelOptSpelling, WireFormat, register

# ModelOpt's guard for a vanishing amax (the smallest FP16 subnormal).
_MODELOPT_TINY_AMAX = 2.0**-24
# DeepGEMM's clamp of a block amax before the scale is formed.
_DEEPGEMM_AMAX_FLOOR = 1e-4


class FP8PerTensor(WireFormat):
    """``fp8``: FP8 E4M3 with one FP32 scale per tensor, ModelOpt's eager fake quant.

    Math, all in FP32 (``fl`` = one FP32 rounding)::

        safe = amax if amax > 2^-24 else 1          # ModelOpt's fallback, also for amax = 0
        s    = 448 * fl(1 / safe)                   # ModelOpt writes 448.0 / safe; torch
                                                    # evaluates it as 448 * reciprocal(safe)
        q    = e4m3(fl(x.float() * s))              # clamp to ±448, then RNE
        out  = fl(q * fl(1 / s)).to(x.dtype)

    The two roundings in ``s`` are ModelOpt's and differ from a true ``448 / safe`` by one
    ulp for some amax; that ulp can move a value across an E4M3 rounding boundary.

    Special values: NaN stays NaN; ±inf and anything beyond the range saturate to
    ``±448 / s``; -0.0 stays -0.0. The amax comes from the caller (``needs_amax``); a host
    amax must be finite and >= 0 (0 and anything <= 2^-24 take ModelOpt's fallback
    ``safe = 1``). Row-local once the amax is fixed.
    """

    name = "fp8"
    modelopt_spelling: ModelOptSpelling | None = ModelOptSpelling(num_bits=(4, 3))

    def __init__(self) -> None:
        # The element's largest value and its saturating RNE cast (FP32 -> FP32).
        self._max, self._cast = fp8_element(format_table.facts(self.name).element)

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        amax = self.required_amax(amax)
        safe = torch.where(amax > _MODELOPT_TINY_AMAX, amax, torch.ones_like(amax))
        scale = self._max * torch.reciprocal(safe)
        q = self._cast(x.to(torch.float32) * scale)
        return (q * torch.reciprocal(scale)).to(x.dtype)


class FP8FNUZPerTensor(FP8PerTensor):
    """``fp8_e4m3fnuz``: FP8 E4M3 FNUZ, MI300's FP8, with one FP32 scale per tensor.

    Math, all in FP32 (``fl`` = one FP32 rounding): :class:`FP8PerTensor`'s, with FNUZ's
    largest value 240 for E4M3's 448 and the FNUZ element::

        safe = amax if amax > 2^-24 else 1
        s    = 240 * fl(1 / safe)
        q    = e4m3fnuz(fl(x.float() * s))          # clamp to ±240, then RNE (step 2^-10
                                                    # below 2^-7); no -0: a negative value
                                                    # that rounds to zero is +0.0
        out  = fl(q * fl(1 / s)).to(x.dtype)

    The element is ``torch.float8_e4m3fnuz`` (``ml_dtypes.float8_e4m3fnuz``): exponent bias
    8, no infinity, and 0x80 is its one NaN, so there is no negative zero. MI300 (gfx942)
    converts to it in hardware (ROCm/clr ``hipamd/include/hip/amd_detail/amd_hip_fp8.h``:
    ``HIP_FP8_TYPE_FNUZ`` on gfx942, ``__builtin_amdgcn_cvt_pk_fp8_f32``, round to nearest
    even), and vLLM's ``current_platform.fp8_dtype()`` is this type there. The per-tensor
    scale is ``fp8``'s rule (ModelOpt's eager fake quant), the format ``fp8`` becomes when
    its FP8 type is FNUZ, for an amax calibrated on the MI300 side; no shipped combine
    uses it as is (the MoRI combines in :mod:`moewire.formats.mori` send FNUZ with block
    scales or none).

    Special values: NaN stays NaN; ±inf and anything beyond the range saturate to
    ``±240 / s``; -0.0 comes back as +0.0. The amax rules are ``fp8``'s. Row-local once the
    amax is fixed. No ModelOpt spelling (``num_bits=(4, 3)`` is E4M3): a cfg names it with
    ``format``.
    """

    name = "fp8_e4m3fnuz"
    modelopt_spelling = None


class FP8Block(WireFormat):
    """FP8 E4M3 with one scale per ``block`` elements of a row (DeepGEMM's reference cast).

    Math per block ``b`` of ``block`` consecutive elements along the last dim, FP32::

        amax = max(max|x_b|, 1e-4)                  # torch.clamp: a NaN amax stays NaN
        sf   = fl(amax * fl(1 / 448))               # DeepGEMM's `amax / 448.0` on CUDA
        sf   = ceil_to_ue8m0(sf)                    # UE8M0 variants only: 2^ceil(log2 sf)
        q    = e4m3(fl(x_b * fl(1 / sf)))
        out  = fl(q * sf).to(x.dtype)

    This is DeepGEMM's ``per_token_cast_to_fp8(x, use_ue8m0, gran_k)``
    (``deep_gemm/utils/math.py``) as it runs on CUDA: there torch evaluates the tensor
    divided by the constant, ``amax / 448.0``, as ``amax * fl(1/448)`` (its CUDA division
    by a CPU scalar multiplies by the FP32 reciprocal), which differs by one ulp from a
    true division for about half of all amax values. The reference writes that product
    out (:func:`~moewire.formats._numerics.mul_recip`), so it gives the same bits on CPU
    and CUDA. ``x * (1.0 / sf)`` multiplies by the FP32 reciprocal of the scale, and
    ``ceil_to_ue8m0`` works on the exponent bits, so it is an exact ``ceil(log2)``. The
    UE8M0 variants get the same scale from either division (the two quotients never fall
    on opposite sides of a power of two for ``amax >= 1e-4``); only ``fp8_b128``'s FP32
    scale sees the ulp. For finite input the clamp inside :func:`e4m3` never fires
    (``|x_b| * fl(1/sf) <= 448``).

    Special values (they follow from the math, as in DeepGEMM's cast):

    - all-zero block: ``amax`` = 1e-4, output zeros (signs kept), never NaN;
    - FP32 scale (``fp8_b128``): a block holding ±inf or NaN gets ``sf`` = inf/NaN and
      dequantizes to all NaN;
    - UE8M0 scale: ``ceil_to_ue8m0`` maps an inf/NaN ``sf`` to 2^127, so a NaN element
      stays NaN, ±inf saturates to ``±448 * 2^127`` = ±inf in FP32, and the finite
      elements of that block flush to (signed) zero unless |x| > 2^117.

    The block and the scale (FP32, or UE8M0 for ``ue8m0``) are the format's row in
    ``moewire.format_table``. ``spelled=False``: ModelOpt's attributes for it name another
    format (E4M3 with UE8M0 scales per 32 is ``mxfp8``), so a cfg names it with ``format``.
    """

    def __init__(self, name: str, spelled: bool = True) -> None:
        self.name = name
        self.ue8m0 = format_table.facts(name).scale == "block_ue8m0"
        if spelled:
            self.modelopt_spelling = ModelOptSpelling(
                (4, 3), scale_bits=(8, 0) if self.ue8m0 else None
            )

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        xb = split_blocks(x, format_table.facts(self.name).block)
        block_amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=_DEEPGEMM_AMAX_FLOOR)
        sf = mul_recip(block_amax, E4M3_MAX)
        if self.ue8m0:
            sf = ceil_pow2_ue8m0(sf)
        q = e4m3(xb * torch.reciprocal(sf))
        return (q * sf).reshape(x.shape).to(x.dtype)


register(FP8PerTensor)
register(FP8FNUZPerTensor)
register(FP8Block("fp8_b128"))
register(FP8Block("fp8_b128_ue8m0"))
register(FP8Block("fp8_b32_ue8m0", spelled=False))
