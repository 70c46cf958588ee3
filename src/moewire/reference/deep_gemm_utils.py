"""Stand-in for DeepGEMM's ``deep_gemm.utils`` package (``deep_gemm/utils/math.py``).

DeepGEMM defines its casts in ``deep_gemm.utils.math``, re-exports them from
``deep_gemm.utils`` and again from ``deep_gemm`` itself (``from .utils import *``), so a
caller may reach :func:`per_token_cast_to_fp8` as ``deep_gemm.utils.per_token_cast_to_fp8``
(vLLM main's ``DeepGemmMegaExperts``) or ``deep_gemm.per_token_cast_to_fp8``. The stand-in
``deep_gemm`` module binds this module as its ``utils`` attribute and re-exports the cast.

May import: torch, ``moewire.reference._alloc`` and ``moewire.reference._numerics``.
"""

from __future__ import annotations

import torch

from moewire.reference._alloc import align as _align
from moewire.reference._numerics import FP8_MAX, ceil_to_ue8m0, pack_ue8m0

__all__ = ["per_token_cast_to_fp8"]


def per_token_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per-token FP8 cast (``deep_gemm.utils.math.per_token_cast_to_fp8``).

    Per row and per ``gran_k`` columns (the last group zero-padded): ``amax = max(max|x|,
    1e-4)``, ``sf = amax / 448`` in FP32, rounded up to a power of two when ``use_ue8m0``;
    ``q = e4m3(x * (1 / sf))``.

    Args:
        x: ``[M, N]`` floating tensor.
        use_ue8m0: power-of-two scales.
        gran_k: group size along N.
        use_packed_ue8m0: return the scales packed four per int32 (needs ``use_ue8m0`` and a
            group count divisible by 4).

    Returns:
        ``(q, sf)``: FP8 E4M3 ``[M, N]`` and FP32 ``[M, ceil(N / gran_k)]`` scales (int32
        ``[M, ceil(N / gran_k) / 4]`` when packed).
    """
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8: x must be 2-D [M, N], got shape {tuple(x.shape)}")
    m, n = x.shape
    padded_n = _align(n, gran_k)
    if use_packed_ue8m0 and (not use_ue8m0 or (padded_n // gran_k) % 4):
        raise ValueError(
            "per_token_cast_to_fp8: use_packed_ue8m0 needs use_ue8m0=True and a number of "
            f"groups divisible by 4 (N={n}, gran_k={gran_k})"
        )
    padded = torch.zeros((m, padded_n), dtype=x.dtype, device=x.device)
    padded[:, :n] = x
    groups = padded.view(m, padded_n // gran_k, gran_k)
    # DeepGEMM writes amax / 448; on CUDA, where it runs, torch evaluates a division by a
    # Python constant as a multiplication by its FP32 reciprocal: do that on every device.
    # A 0-dim CPU tensor: CUDA ops take it as a scalar, so nothing is copied to the
    # device (a copy would break CUDA-graph capture).
    recip = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    sf = groups.abs().float().amax(dim=2).clamp(min=1e-4) * recip
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    q = (groups * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn)
    q = q.view(m, padded_n)[:, :n].contiguous()
    return q, (pack_ue8m0(sf) if use_packed_ue8m0 else sf)

