"""The fake-quantization kernel's entry point: :func:`qdq` (the dispatch quantizer, and
``WireFormat.qdq`` on CUDA)."""

from __future__ import annotations

import torch

from moewire.kernels import tuning
from moewire.kernels.launch import (
    _FLOAT_DTYPES,
    _amax_tensor,
    _check_blocks,
    _check_device,
    _check_format,
    _impl,
    _triton_mod,
)

__all__ = ["qdq"]


def qdq(
    x: torch.Tensor,
    fmt_name: str,
    amax: torch.Tensor | float | None,
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` in ``fmt_name``, bit-exact to ``formats.get(fmt_name).reference``.

    Args:
        x: BF16/FP16/FP32 ``[..., H]`` on CUDA; blocks run along the last dim (H a multiple
            of the format's block size: the caller, ``WireFormat.qdq``, validates that).
        fmt_name: one of :data:`SUPPORTED_FORMATS`.
        amax: FP32 one-element tensor (or number) for ``fp8`` and ``nvfp4``; ignored by
            the other formats.
        block_h: columns per program (a power of two >= 128); tuning only.
        num_warps: warps per program; tuning only.

    Returns:
        A new tensor, same shape and dtype as ``x``.
    """
    _check_format(fmt_name)
    _check_device(x, "x")
    if x.dtype not in _FLOAT_DTYPES or x.dim() == 0:
        raise ValueError(
            f"moewire.kernels.qdq: x must be a BF16/FP16/FP32 tensor with at least one dim, "
            f"got {x.dtype} {list(x.shape)}"
        )
    impl = _impl()
    hidden = x.shape[-1]
    _check_blocks("moewire.kernels.qdq: the last dim", hidden, fmt_name)
    amax_t = _amax_tensor(fmt_name, amax, x.device)
    flat = x.reshape(-1, hidden)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty_like(flat, memory_format=torch.contiguous_format)
    if flat.numel() == 0:
        return out.reshape(x.shape)
    bh = tuning.block_h(fmt_name, hidden, block_h, pad_least=False)
    grid = (flat.shape[0], _triton_mod().cdiv(hidden, bh))
    impl.qdq_kernel[grid](
        flat, out, amax_t if amax_t is not None else flat, hidden, flat.stride(0), out.stride(0),
        FMT=impl.FORMAT_CODES[fmt_name], HAS_AMAX=amax_t is not None, BLOCK_H=bh,
        HW_CAST=x.is_cuda, num_warps=tuning.num_warps(fmt_name, bh, num_warps),
        enable_fp_fusion=False,
    )
    return out.reshape(x.shape)
