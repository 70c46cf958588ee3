"""The NVFP4 casts of the stand-in NVFP4 x NVFP4 Mega-MoE (DeepGEMM 2.8.0 ``fp4_fp4_mega_moe``).

Written from the sources, independently of ``moewire.formats``:

- vLLM main's staging kernel ``vllm/models/deepseek_v32/nvidia/ops/prepare_megamoe_nvfp4.py``
  (05be1d5, ``_prepare_megamoe_nvfp4_inputs_kernel``): per 16 elements
  ``sf = e4m3(max(fl(amax * fl(1/6)), 2^-9))`` and ``code = e2m1(fl(x / sf))`` (``div.rn``);
  no per-token or global scale (vLLM folds none into the L1 alphas either).
- DeepGEMM's L1 epilogue (``impls/sm100_fp4_fp4_mega_moe.cuh`` at 794783a,
  ``get_nvfp4_e4m3_sf_and_sf_inv``): the unweighted SwiGLU output ``h`` is requantized per 16
  channels with ``inv = fl(1 / a2_scale)``: ``sf = e4m3(max(fl(fl(amax * fl(1/6)) * inv),
  2^-9))``, ``code = e2m1(fl(h * fl(inv / sf)))`` (``cvt.rn.satfinite.e2m1x2``); the L2 GEMM
  reads ``e2m1 * sf`` and ``a2_scale`` is folded into the L2 scale. The kernel's ``fast_math``
  takes ``inv / sf`` as ``inv * rcp.approx(sf)``; the stand-in divides exactly (as the
  kernel with ``fast_math=False``).

E4M3 conversions round to nearest even and saturate at 448 (``satfinite``); E2M1 rounds to
nearest even on {0, 0.5, 1, 1.5, 2, 3, 4, 6} and saturates at 6. ``fl(.)`` is one FP32
rounding.

May import: torch, ``moewire.reference._numerics`` and ``moewire.reference.nvfp4._numerics``.
"""

from __future__ import annotations

import torch

from moewire.reference._numerics import FP4_MAX, quantize_e2m1
from moewire.reference.nvfp4._numerics import (
    E4M3_MIN,
    NVFP4_BLOCK,
    e4m3,
    pack_e4m3,
    pack_fp4_codes,
)

__all__ = ["block_scales", "requantize_l2_input", "stage_nvfp4_tokens"]


def block_scales(amax: torch.Tensor, inv_global: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 block scales (as FP32) of FP32 block amaxes: ``e4m3(max(fl(fl(amax * fl(1/6)) *
    inv_global), 2^-9))``; ``inv_global`` (FP32, broadcastable) is 1 when ``None``."""
    scaled = amax.float() * torch.tensor(1.0 / FP4_MAX)
    if inv_global is not None:
        scaled = scaled * inv_global
    return e4m3(torch.clamp(scaled, min=E4M3_MIN))


def stage_nvfp4_tokens(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM main's NVFP4 staging of ``[T, H]`` tokens (the module docstring's formula).

    Returns:
        ``(x, x_sf)``: uint8 ``[T, H/2]`` (E2M1 pairs, element ``2j`` in the low nibble) and
        int32 ``[T, H/64]`` (four E4M3 bytes per int, byte ``j`` of int ``i`` scales block
        ``4i + j``).
    """
    groups = hidden.float().unflatten(-1, (-1, NVFP4_BLOCK))
    sf = block_scales(groups.abs().amax(dim=-1, keepdim=True))
    codes = quantize_e2m1(groups / sf).flatten(-2)
    return pack_fp4_codes(codes).view(torch.uint8), pack_e4m3(sf.squeeze(-1))


def requantize_l2_input(
    h: torch.Tensor, a2_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's NVFP4 cast of the unweighted SwiGLU output (the module docstring).

    Args:
        h: FP32 ``[N, I]``.
        a2_scale: FP32 ``[N]``, the row's expert's ``a2_scales`` entry (positive, finite),
            or ``None`` (1).

    Returns:
        ``(codes, sf)``: E2M1 codes uint8 ``[N, I]`` and the E4M3 block scales FP32
        ``[N, I/16]``; the GEMM reads ``e2m1 * sf``.
    """
    groups = h.float().unflatten(-1, (-1, NVFP4_BLOCK))
    inv = None if a2_scale is None else (1.0 / a2_scale.float()).view(-1, 1, 1)
    sf = block_scales(groups.abs().amax(dim=-1, keepdim=True), inv)
    factor = (1.0 / sf) if inv is None else inv / sf
    return quantize_e2m1(groups * factor).flatten(-2), sf.squeeze(-1)
