"""NVFP4 wire formats: FP4 E2M1 elements, an E4M3 scale per 16, an FP32 global scale.

``nvfp4`` takes its global scale from a tensor amax (ModelOpt's static global amax with a
dynamic block scale); ``nvfp4_token`` from each row's own amax (TensorRT-LLM's
low-precision combine sends one FP32 global scale per token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire.format_table import FORMATS
from moewire.formats._numerics import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_magnitude,
    e4m3,
    mul_recip,
    split_blocks,
)
from moewire.formats.base import ModelOptSpelling, WireFormat, register

# The block of both NVFP4 formats (their rows in moewire.format_table).
_NVFP4_BLOCK = FORMATS["nvfp4"].block
# ModelOpt's global scale when the amax is <= 0.
_GS_FALLBACK = 1e-12
# ModelOpt replaces a block scale below this by 1 (the block then quantizes to zero).
_BS_TINY = 1e-5


def nvfp4_qdq(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quant of ``x`` with global scale ``gs``, ModelOpt's math, in FP32.

    Args:
        x: ``[..., H]``, H a multiple of 16, any float dtype.
        gs: FP32 global scale, broadcastable to ``[..., 1, 1]`` (``[]`` or ``[..., 1, 1]``).

    Returns:
        FP32 ``[..., H]``. Per block of 16: ``bmax = max|x|``,
        ``bs = e4m3(min(bmax / (6 * gs), 448)) * gs`` (``bs = 1`` where ``bs < 1e-5``),
        ``out = sign(x) * e2m1(|x| / bs) * bs``.
    """
    import torch

    xb = split_blocks(x, _NVFP4_BLOCK)
    bmax = xb.abs().amax(dim=-1, keepdim=True)
    bs = e4m3((bmax / (E2M1_MAX * gs)).clamp(max=E4M3_MAX)) * gs
    bs = torch.where(bs < _BS_TINY, torch.ones_like(bs), bs)
    q = e2m1_magnitude(xb.abs() / bs)
    return (torch.sign(xb) * q * bs).reshape(x.shape)


class NVFP4(WireFormat):
    """``nvfp4``: ModelOpt's NVFP4 fake quant with a static global amax.

    Math, FP32 (``fl`` = one FP32 rounding), blocks of 16 along the last dim::

        gs   = fl(amax * fl(1/2688)) if amax > 0 else 1e-12   # 2688 = 6 * 448
        bmax = max|x_b|
        bs   = e4m3(min(fl(bmax / fl(6 * gs)), 448)) * gs  # the E4M3 block scale, decoded
        bs   = 1 if bs < 1e-5 else bs
        a    = fl(|x| / bs)
        q    = e2m1(a)   # a <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5,
                         # <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6  (RNE, saturating)
        out  = (sign(x) * q * bs).to(x.dtype)

    ``sign`` is torch's: ``-0.0`` comes out as ``+0.0`` and a small negative that rounds
    to zero as ``-0.0``, as in ModelOpt.

    The global scale is ModelOpt's ``amax / (6 * 448)`` as torch evaluates it on CUDA,
    where ModelOpt runs: a tensor divided by a Python constant is a multiplication by the
    FP32 reciprocal there, ``amax * fl(1/2688)`` (one ulp away from a true division for
    about a fifth of all amax values). The reference writes that product out
    (:func:`~moewire.formats._numerics.mul_recip`), so CPU and CUDA give the same bits.
    The divisions by tensors, ``bmax / (6 * gs)`` and ``|x| / bs``, are true divisions on
    both devices.

    Special values: NaN in a block makes ``bmax`` NaN and the whole block NaN; ±inf
    saturates (its block scale is ``448 * gs``, the element ``±6 * bs``, the rest of the
    block quantizes against that scale); an all-zero block stays zero. Host amax: finite
    and >= 0 (0 takes ModelOpt's ``gs = 1e-12``). Row-local once the amax is fixed.

    Not idempotent everywhere: the block scale is formed from ``bmax``, not from the
    grid, so a block whose E4M3 block scale is subnormal (``bmax < 6 * gs * 2^-6``, a
    block far below the global amax) can re-quantize to a different scale; blocks with a
    normal E4M3 scale satisfy ``q(q(x)) == q(x)`` by value.
    """

    name = "nvfp4"
    modelopt_spelling = ModelOptSpelling(num_bits=(2, 1), scale_bits=(4, 3))

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        amax = self.required_amax(amax)
        gs = torch.where(
            amax > 0, mul_recip(amax, E2M1_MAX * E4M3_MAX), torch.full_like(amax, _GS_FALLBACK)
        )
        return nvfp4_qdq(x, gs).to(x.dtype)


class NVFP4Token(WireFormat):
    """``nvfp4_token``: NVFP4 with a per-row FP32 global scale from the row's own amax.

    Math: as :class:`NVFP4` with ``amax = max|x[..., :]|`` of each row (TensorRT-LLM's
    low-precision combine), i.e. ``gs = fl(amax_row * fl(1/2688))`` (the reciprocal form,
    as torch computes ``amax_row / 2688`` on CUDA; see :class:`NVFP4`), ``1e-12`` for an
    all-zero row. The row's FP32 global scale travels with it (``row_scale_bits = 32``).

    Special values: a row holding NaN gets a NaN ``gs`` and comes out all NaN; a row
    holding ±inf gets ``gs = inf`` and also comes out all NaN (``0 * inf``); a zero row
    stays zero. Row-local, no amax.
    """

    name = "nvfp4_token"
    modelopt_spelling = ModelOptSpelling(num_bits=(2, 1), scale_bits=(4, 3), axis=0)

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        row_amax = x.to(torch.float32).abs().amax(dim=-1, keepdim=True).unsqueeze(-1)
        # `== 0` rather than `<= 0`: a NaN row must keep a NaN scale (and come out NaN).
        gs = torch.where(
            row_amax == 0,
            torch.full_like(row_amax, _GS_FALLBACK),
            mul_recip(row_amax, E2M1_MAX * E4M3_MAX),
        )
        return nvfp4_qdq(x, gs).to(x.dtype)


register(NVFP4)
register(NVFP4Token)
