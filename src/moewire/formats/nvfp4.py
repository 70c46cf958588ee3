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
# ModelOpt's global scale where ``amax / 2688`` is not positive.
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


def nvfp4_global_scale(amax: torch.Tensor, *, keep_nan: bool = False) -> torch.Tensor:
    """NVFP4's FP32 global scale of an FP32 ``amax`` (any shape), with ModelOpt's fallback.

    Math, FP32 (``fl`` = one FP32 rounding)::

        gs = fl(amax * fl(1/2688))          # 2688 = 6 * 448; torch's CUDA ``amax / 2688``
        gs = 1e-12  where not gs > 0        # keep_nan=False (nvfp4)
        gs = 1e-12  where gs == 0           # keep_nan=True  (nvfp4_token: NaN stays NaN)

    The fallback tests the product, not the amax: a positive FP32 amax of at most
    ``1343 * 2^-149`` (about 1.88e-42, a subnormal) has ``amax * fl(1/2688)`` below half
    the smallest subnormal, which rounds to 0; a global scale of 0 would make every block
    scale ``bmax / (6 * 0)``, NaN for an all-zero block (``0 / 0``). Such an amax takes
    ``1e-12`` like ``amax = 0``; from ``1344 * 2^-149`` up the product is positive and is
    kept. Either way ``bs = e4m3(...) * gs <= 448 * gs < 1e-5`` becomes 1, so every such
    global scale gives the same output.

    This is ModelOpt 0.47.0's test: ``fp4_fake_quant_block``
    (``modelopt/torch/kernels/quantization/gemm/fp4_kernel_hopper.py``), the fake quant of a
    dynamic-block NVFP4 quantizer on a GPU of compute capability 8.9 or newer, forms
    ``global_scale = global_amax.float() / (6.0 * 448.0)`` in torch and uses
    ``tl.where(global_scale > 0.0, global_scale, 1e-12)`` in the kernel, so a NaN amax also
    takes 1e-12 there (``keep_nan=False``). ModelOpt's export of the scales
    (``NVFP4QTensor.get_weights_scaling_factor`` in ``qtensor/nvfp4_tensor.py``) has no
    such guard: with an underflowed ``weights_scaling_factor_2`` it divides by zero, a
    per-block scale of inf for a non-zero block (stored as E4M3 448 after its clamp to
    ``[2^-9, 448]``) and NaN (``0 / 0``) for an all-zero one (stored as E4M3 NaN).

    Args:
        amax: FP32 tensor, any shape and device: a tensor amax (``[]``) or row maxima.
        keep_nan: ``True`` keeps a NaN ``gs`` (a row holding NaN stays NaN).

    Returns:
        FP32 ``gs``, same shape and device as ``amax``.
    """
    import torch

    gs = mul_recip(amax, E2M1_MAX * E4M3_MAX)
    fallback = gs == 0 if keep_nan else ~(gs > 0)
    return torch.where(fallback, torch.full_like(gs, _GS_FALLBACK), gs)


class NVFP4(WireFormat):
    """``nvfp4``: ModelOpt's NVFP4 fake quant with a static global amax.

    Math, FP32 (``fl`` = one FP32 rounding), blocks of 16 along the last dim::

        gs   = fl(amax * fl(1/2688))        # 2688 = 6 * 448
        gs   = gs if gs > 0 else 1e-12      # amax <= 0 or NaN, or gs underflowed to 0
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
    The fallback tests that product, as ModelOpt's fake-quant kernel does
    (:func:`nvfp4_global_scale`): a positive subnormal amax whose product underflows to 0
    takes ``1e-12`` too, instead of a zero global scale that makes an all-zero block NaN.
    The divisions by tensors, ``bmax / (6 * gs)`` and ``|x| / bs``, are true divisions on
    both devices.

    Special values: NaN in a block makes ``bmax`` NaN and the whole block NaN; ±inf
    saturates (its block scale is ``448 * gs``, the element ``±6 * bs``, the rest of the
    block quantizes against that scale); an all-zero block stays zero. Host amax: finite
    and >= 0 (0, and a subnormal amax up to about 1.88e-42, take ModelOpt's ``gs = 1e-12``;
    a CUDA amax is not inspected, and a NaN one takes ``1e-12`` as in ModelOpt's kernel).
    Row-local once the amax is fixed.

    Not idempotent everywhere: the block scale is formed from ``bmax``, not from the
    grid, so a block whose E4M3 block scale is subnormal (``bmax < 6 * gs * 2^-6``, a
    block far below the global amax) can re-quantize to a different scale; blocks with a
    normal E4M3 scale satisfy ``q(q(x)) == q(x)`` by value.
    """

    name = "nvfp4"
    modelopt_spelling = ModelOptSpelling(num_bits=(2, 1), scale_bits=(4, 3))

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        gs = nvfp4_global_scale(self.required_amax(amax))
        return nvfp4_qdq(x, gs).to(x.dtype)


class NVFP4Token(WireFormat):
    """``nvfp4_token``: NVFP4 with a per-row FP32 global scale from the row's own amax.

    Math: as :class:`NVFP4` with ``amax = max|x[..., :]|`` of each row (TensorRT-LLM's
    low-precision combine), i.e. ``gs = fl(amax_row * fl(1/2688))`` (the reciprocal form,
    as torch computes ``amax_row / 2688`` on CUDA; see :class:`NVFP4`), ``1e-12`` where that
    product is 0: an all-zero row, or an FP32 row whose max is a subnormal of at most about
    1.88e-42 (:func:`nvfp4_global_scale` with ``keep_nan=True``; no BF16 or FP16 row gets
    there). The row's FP32 global scale travels with it (``row_scale_bits = 32``).

    Special values: a row holding NaN gets a NaN ``gs`` and comes out all NaN; a row
    holding ±inf gets ``gs = inf`` and also comes out all NaN (``0 * inf``); a zero row
    stays zero. Row-local, no amax.
    """

    name = "nvfp4_token"
    modelopt_spelling = ModelOptSpelling(num_bits=(2, 1), scale_bits=(4, 3), axis=0)

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        row_amax = x.to(torch.float32).abs().amax(dim=-1, keepdim=True).unsqueeze(-1)
        # A NaN row must keep a NaN scale (and come out NaN).
        gs = nvfp4_global_scale(row_amax, keep_nan=True)
        return nvfp4_qdq(x, gs).to(x.dtype)


register(NVFP4)
register(NVFP4Token)
