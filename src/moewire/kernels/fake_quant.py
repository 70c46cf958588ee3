"""The fake-quantization kernel's entry point: :func:`qdq` (the dispatch quantizer, and
``WireFormat.qdq`` on CUDA)."""

from __future__ import annotations

import torch

from moewire.format_table import FormatFacts
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
    fmt: FormatFacts | str,
    amax: torch.Tensor | float | None,
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` in the format ``fmt``, bit-exact to its ``reference``.

    Args:
        x: BF16/FP16/FP32 ``[..., H]`` on CUDA; blocks run along the last dim (H a multiple
            of the format's block size: the caller, ``WireFormat.qdq``, validates that).
        fmt: the format's row of ``moewire.format_table`` (``WireFormat.facts``), or the
            name of one, of :data:`SUPPORTED_FORMATS`.
        amax: FP32 one-element tensor (or number) for the formats that need one (``fp8``,
            ``nvfp4``, ``fp8_e4m3fnuz``); ignored by the others.
        block_h: columns per program (a power of two >= 128); tuning only.
        num_warps: warps per program; tuning only.

    Returns:
        A new tensor, same shape and dtype as ``x``.
    """
    row = _check_format(fmt)
    _check_device(x, "x")
    if x.dtype not in _FLOAT_DTYPES or x.dim() == 0:
        raise ValueError(
            f"moewire.kernels.qdq: x must be a BF16/FP16/FP32 tensor with at least one dim, "
            f"got {x.dtype} {list(x.shape)}"
        )
    impl = _impl()
    hidden = x.shape[-1]
    _check_blocks("moewire.kernels.qdq: the last dim", hidden, row)
    amax_t = _amax_tensor(row, amax, x.device)
    flat = x.reshape(-1, hidden)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty_like(flat, memory_format=torch.contiguous_format)
    if flat.numel() == 0:
        return out.reshape(x.shape)
    bh = tuning.block_h(row, hidden, block_h, pad_least=False)
    grid = (flat.shape[0], _triton_mod().cdiv(hidden, bh))
    impl.qdq_kernel[grid](
        flat, out, amax_t if amax_t is not None else flat, hidden, flat.stride(0), out.stride(0),
        FMT=row.kernel_code, SPLIT=row.split_tile, HAS_AMAX=amax_t is not None, BLOCK_H=bh,
        HW_CAST=x.is_cuda, num_warps=tuning.num_warps(row, bh, num_warps),
        enable_fp_fusion=False,
    )
    return out.reshape(x.shape)
