"""Seeded random weights for the stand-in NVFP4 x NVFP4 Mega-MoE (:mod:`.mega_moe`).

Routed experts are NVFP4 the way ModelOpt's NVFP4 checkpoints store them and vLLM main's
``DeepseekV32MegaMoEExperts`` loads them (``vllm/models/deepseek_v32/nvidia/mega_moe.py``,
30a3a7a): per expert ``w1`` (gate), ``w3`` (up) and ``w2`` (down), each with its own FP32
``weight_scale_2`` (the NVFP4 family's ``quantize_nvfp4_weight``: ``gs = fl(amax *
fl(1/2688))``, E4M3 scales per 16 of ``amax16 / (6 gs)``); the kernel reads ``e2m1 * e4m3``
and takes ``(gs_w1, gs_w3)`` as ``l1_alphas`` and ``gs_w2`` as ``l2_alphas``. A fused shared
expert is BF16 (DeepGEMM 2.8.0 runs it in BF16 from ``x_bf16``).

May import: torch, ``moewire.reference.weights`` (the holder's builder) and the NVFP4
family's ``nvfp4.weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moewire.reference.nvfp4.weights import quantize_nvfp4_weight
from moewire.reference.weights import (
    add_shared_expert,
    dense_expert,
    expert_ids,
    quantized_weights,
)

__all__ = ["FP4MegaMoEWeights", "make_fp4_fp4_weights", "quantize_expert"]


@dataclass
class FP4MegaMoEWeights:
    """NVFP4 x NVFP4 expert weights of one rank (or any subset of experts).

    Attributes:
        experts: the global expert ids held, in order.
        l1, l2: ``(int8, int32)`` pairs transformed for the kernel.
        l1_raw, l2_raw: the same before the transform (L1 rows ``[gate | up]``).
        l1_alphas: FP32 ``[E, 2]``, ``weight_scale_2`` of w1 and w3; l2_alphas: FP32 ``[E]``.
        shared_l1, shared_l2: a fused BF16 shared expert, transformed (or None);
        shared_l1_raw, shared_l2_raw: the same before the transform.
    """

    experts: tuple[int, ...]
    l1: tuple[torch.Tensor, torch.Tensor]
    l2: tuple[torch.Tensor, torch.Tensor]
    l1_raw: tuple[torch.Tensor, torch.Tensor]
    l2_raw: tuple[torch.Tensor, torch.Tensor]
    l1_alphas: torch.Tensor
    l2_alphas: torch.Tensor
    shared_l1: torch.Tensor | None = None
    shared_l2: torch.Tensor | None = None
    shared_l1_raw: torch.Tensor | None = None
    shared_l2_raw: torch.Tensor | None = None


def quantize_expert(l1: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One expert's dense weights to ModelOpt-style NVFP4 (gate and up with their own global
    scale); an :data:`~moewire.reference.weights.ExpertQuantizer`.

    Args:
        l1: floating ``[2I, H]``, rows ``[gate | up]``; l2: floating ``[H, I]``.

    Returns:
        ``(int8 [2I, H/2], int32 [2I, H/64], FP32 [2], int8 [H, I/2], int32 [H, I/64], FP32
        [])``: L1's codes and scales (not transformed) and the global scales of w1 and w3,
        then L2's.
    """
    inter = l1.shape[0] // 2
    gate, up, down = (quantize_nvfp4_weight(w) for w in (l1[:inter], l1[inter:], l2))
    return (torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]]),
            torch.stack([gate[2], up[2]]), *down)


def make_fp4_fp4_weights(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    experts: Iterable[int] | None = None,
    num_shared_experts: int = 0,
    seed: int = 0,
    outlier_channels: int = 4,
    outlier_scale: float = 16.0,
    device: torch.device | str = "cpu",
) -> FP4MegaMoEWeights:
    """Seeded random NVFP4 expert weights (expert ``e`` from its own seed, as
    :func:`moewire.reference.make_weights`, so a rank's subset equals a one-rank build).

    Args:
        num_experts: routed experts in the model; experts: the global ids to build.
        hidden: H; intermediate: I per expert (multiples of 512).
        num_shared_experts: > 0 builds a fused BF16 shared expert of ``num_shared * I``.
        seed, outlier_channels, outlier_scale: as ``make_weights``.
        device: where the tensors go.
    """
    ids = expert_ids(num_experts, experts, "make_fp4_fp4_weights")
    device = torch.device(device)
    dense = (dense_expert(seed, e, hidden, intermediate, outlier_channels, outlier_scale)
             for e in ids)
    weights = quantized_weights(FP4MegaMoEWeights, quantize_expert, dense, ids, device)
    if num_shared_experts:
        add_shared_expert(weights, num_shared_experts, hidden, intermediate, seed,
                          outlier_channels, outlier_scale, "bf16", device)
    return weights
