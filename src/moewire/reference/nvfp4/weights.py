"""Seeded random weights for the stand-in NVFP4 Mega-MoE (:mod:`.mega_moe`).

Routed experts are NVFP4 the way NVFP4 checkpoints store them (ModelOpt's
``weight`` / ``weight_scale`` / ``weight_scale_2``) and DeepGEMM's
``utils/nvfp4.py::per_token_cast_to_nvfp4`` quantizes them: per expert an FP32 global scale
``gs = fl(amax * fl(1/2688))`` (gate and up share one: vLLM takes one L1 alpha per
expert), per 16 along K ``bs = e4m3(clamp(fl(bmax / fl(6 gs)), 2^-9, 448))``,
``code = e2m1(fl(w / fl(bs * gs)))``; the weight is ``e2m1 * bs * gs``. The kernel reads
``e2m1 * bs`` and takes ``gs`` through ``l1_alpha`` / ``l2_alpha``.

A fused shared expert is MXFP8 (E4M3, UE8M0 per 32) or BF16, as vLLM's
``MEGA_MOE_NVFP4.shared`` allows.

May import: torch, ``moewire.reference._numerics`` and ``moewire.reference.weights`` (the
holder's builder), and the family's ``_numerics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from moewire.reference._numerics import FP4_MAX, FP8_MAX, quantize_e2m1
from moewire.reference.nvfp4._numerics import (
    E4M3_MIN,
    NVFP4_RANGE,
    e4m3,
    pack_e4m3,
    pack_fp4_codes,
)
from moewire.reference.weights import (
    add_shared_expert,
    dense_expert,
    expert_ids,
    quantized_weights,
)

__all__ = ["NVFP4MegaMoEWeights", "make_nvfp4_weights", "quantize_nvfp4_expert",
           "quantize_nvfp4_weight"]


def quantize_nvfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of one expert's weight ``[N, K]`` with its own global scale.

    Returns:
        ``(packed, sf, gs)``: int8 ``[N, K/2]``, int32 ``[N, K/64]`` (E4M3 per 16, four
        per int), FP32 ``[]`` global scale.
    """
    w = w.float()
    gs = w.abs().amax().clamp(min=1e-12) * torch.tensor(1.0 / NVFP4_RANGE)
    blocks = w.unflatten(-1, (-1, 16))
    bmax = blocks.abs().amax(dim=-1, keepdim=True)
    bs = e4m3((bmax / (gs * FP4_MAX)).clamp(E4M3_MIN, FP8_MAX))
    codes = quantize_e2m1(blocks / (bs * gs)).flatten(-2)
    return pack_fp4_codes(codes), pack_e4m3(bs.squeeze(-1)), gs


def quantize_nvfp4_expert(l1: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One expert's dense weights (L1 ``[2I, H]``, L2 ``[H, I]``) to NVFP4, each with its
    own global scale (:func:`quantize_nvfp4_weight`, gate and up sharing L1's); an
    :data:`~moewire.reference.weights.ExpertQuantizer`."""
    return (*quantize_nvfp4_weight(l1), *quantize_nvfp4_weight(l2))


@dataclass
class NVFP4MegaMoEWeights:
    """NVFP4 expert weights of one rank (or any subset of experts).

    Attributes:
        experts: the global expert ids held, in order.
        l1, l2: ``(int8, int32)`` pairs transformed for the kernel.
        l1_raw, l2_raw: the same before the transform (L1 rows ``[gate | up]``).
        l1_global_scale, l2_global_scale: FP32 ``[E]``, the ``weight_scale_2`` of w13 / w2.
        shared_dtype: ``torch.float8_e4m3fn`` or ``torch.bfloat16`` (or None).
        shared_l1, shared_l2, shared_l1_raw, shared_l2_raw: a fused shared expert, or None.
    """

    experts: tuple[int, ...]
    l1: tuple[torch.Tensor, torch.Tensor]
    l2: tuple[torch.Tensor, torch.Tensor]
    l1_raw: tuple[torch.Tensor, torch.Tensor]
    l2_raw: tuple[torch.Tensor, torch.Tensor]
    l1_global_scale: torch.Tensor
    l2_global_scale: torch.Tensor
    shared_dtype: torch.dtype | None = None
    shared_l1: Any = None
    shared_l2: Any = None
    shared_l1_raw: Any = None
    shared_l2_raw: Any = None


def make_nvfp4_weights(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    experts: Iterable[int] | None = None,
    num_shared_experts: int = 0,
    shared_dtype: torch.dtype = torch.float8_e4m3fn,
    seed: int = 0,
    outlier_channels: int = 4,
    outlier_scale: float = 16.0,
    device: torch.device | str = "cpu",
) -> NVFP4MegaMoEWeights:
    """Seeded random NVFP4 expert weights (expert ``e`` from its own seed, as
    :func:`moewire.reference.make_weights`, so a rank's subset equals a one-rank build).

    Args:
        num_experts: routed experts in the model; experts: the global ids to build.
        hidden: H; intermediate: I per expert (multiples of 128).
        num_shared_experts: > 0 builds a fused shared expert of ``num_shared * I``.
        shared_dtype: ``torch.float8_e4m3fn`` (MXFP8) or ``torch.bfloat16``.
        seed, outlier_channels, outlier_scale: as ``make_weights``.
        device: where the tensors go.
    """
    ids = expert_ids(num_experts, experts, "make_nvfp4_weights")
    if shared_dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(
            "make_nvfp4_weights: shared_dtype must be torch.float8_e4m3fn or torch.bfloat16, "
            f"got {shared_dtype!r}"
        )
    device = torch.device(device)
    dense = (dense_expert(seed, e, hidden, intermediate, outlier_channels, outlier_scale)
             for e in ids)
    weights = quantized_weights(NVFP4MegaMoEWeights, quantize_nvfp4_expert, dense, ids, device)
    if num_shared_experts:
        weights.shared_dtype = shared_dtype
        add_shared_expert(weights, num_shared_experts, hidden, intermediate, seed,
                          outlier_channels, outlier_scale,
                          "fp8" if shared_dtype == torch.float8_e4m3fn else "bf16", device)
    return weights
