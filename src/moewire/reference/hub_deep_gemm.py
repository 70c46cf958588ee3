"""Stand-in for the DeepGEMM build transformers loads from the kernels hub.

transformers 5.23.0 (``transformers/integrations/deepgemm.py``, ``_load_deepgemm_kernel``)
loads ``kernels-community/deep-gemm`` and keeps a few of its entry points in a ``DeepGEMM``
dataclass; its Mega-MoE forward uses five: ``utils.per_token_cast_to_fp8``,
``transform_sf_into_required_layout``, ``transform_weights_for_mega_moe``,
``get_symm_buffer_for_mega_moe`` and ``fp8_fp4_mega_moe``. That build is upstream DeepGEMM's
Mega-MoE API (huggingface/kernels-community ``deep-gemm/torch-ext/deep_gemm/mega/__init__.py``
and ``deep-gemm/csrc/apis/mega.hpp``, read at 84232ce and 388adb9): the buffer takes
``use_fp8_dispatch`` and no ``num_shared_experts``, the BF16 ``[k][Tmax][H]`` combine region is
the buffer's last region (after ``l2_sf_buffer``), and the kernel is
``fp8_fp4_mega_moe(y, l1, l2, sym_buffer, cumulative_local_expert_recv_stats=None,
recipe=(1, 1, 32), activation='swiglu', activation_clamp=None, fast_math=True)``.

This module gives those five with upstream's signatures over the stand-in kernel
(:mod:`moewire.reference.deep_gemm`, flavour ``deepgemm-main``), so a caller that reads the
build's facts (which parameters its functions take) reads the facts of the real one.

One difference: ``transform_sf_into_required_layout`` returns the packed UE8M0 scales
row-major, where the real one returns them MN-major and TMA-aligned (``stride(-2) == 1``);
the values are the same and the stand-in kernel reads values, not strides.

May import: torch and ``moewire.reference.deep_gemm`` with the modules below it.
"""

from __future__ import annotations

from typing import Any

import torch

from moewire.reference import deep_gemm
from moewire.reference import deep_gemm_utils as utils
from moewire.reference._numerics import pack_ue8m0
from moewire.reference.buffer import SymmBuffer

__all__ = [
    "FLAVOUR",
    "fp8_fp4_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "transform_sf_into_required_layout",
    "transform_weights_for_mega_moe",
    "utils",
]

#: The stand-in flavour of the kernels-hub build: upstream DeepGEMM, combine region last.
FLAVOUR = "deepgemm-main"
# FP8 x FP4 weights carry one UE8M0 scale per 32 elements along K, per row (gran_mn 1).
_WEIGHT_RECIPE = (1, 32)


def get_symm_buffer_for_mega_moe(
    group: Any,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    use_fp8_dispatch: bool = True,
    activation: str = "swiglu",
) -> SymmBuffer:
    """Upstream's buffer: ``fp8xfp4``, no fused shared expert, the combine region last.

    Args:
        group: the EP process group (experts split evenly over its ranks).
        num_experts: routed experts over the whole group.
        num_max_tokens_per_rank: requested capacity, rounded up to 384 (read the real one
            back from ``buffer.num_max_tokens_per_rank``).
        num_topk, hidden, intermediate_hidden: as upstream (``H`` and ``I`` multiples of 512
            for the stand-in's FP8 x FP4 kernel).
        use_fp8_dispatch: upstream's FP8 dispatch; only ``True`` (what transformers passes by
            default) has a stand-in.
        activation: ``"swiglu"``.

    Raises:
        ValueError: ``use_fp8_dispatch=False``, or what the stand-in's buffer refuses.
    """
    if use_fp8_dispatch is not True:
        raise ValueError(
            "get_symm_buffer_for_mega_moe: the stand-in of the kernels-hub DeepGEMM has the "
            "FP8 dispatch only (use_fp8_dispatch=True, what transformers 5.23 passes)"
        )
    with deep_gemm.use_flavour(FLAVOUR):
        return deep_gemm.get_symm_buffer_for_mega_moe(
            group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
            intermediate_hidden, mma_type="fp8xfp4", activation=activation,
        )


def transform_sf_into_required_layout(
    sf: torch.Tensor,
    mn: int,
    k: int,
    recipe: tuple[int, ...] = _WEIGHT_RECIPE,
    num_groups: int | None = None,
    is_sfa: bool | None = None,
    disable_ue8m0_cast: bool = False,
) -> torch.Tensor:
    """FP32 power-of-two scales, one per 32 along K, packed four per int32 (UE8M0).

    As DeepGEMM's ``(FP32, 1, 32)`` branch on SM100 (``csrc/apis/layout.hpp``): the exponent
    byte of each scale, four consecutive K groups per int32; the stand-in keeps the rows
    row-major (module docstring).

    Args:
        sf: FP32 ``[num_groups, mn, k / 32]`` (or 2-D without the group dim), each value a
            power of two (UE8M0 scales upcast, as transformers' ``setup_megamoe_weights``
            passes them).
        mn, k: the weight's rows and columns.
        recipe: ``(1, 32)`` (``(gran_mn, gran_k)``), or ``(1, 1, 32)`` with ``is_sfa``.
        num_groups: the expert count, checked against ``sf``.
        is_sfa, disable_ue8m0_cast: upstream's; only the UE8M0 cast has a stand-in.

    Returns:
        int32 ``[num_groups, mn, k / 128]`` (2-D in, 2-D out).

    Raises:
        ValueError: another recipe, a shape that does not match, a scale that is not a
            positive power of two, or ``disable_ue8m0_cast``.
    """
    where = "transform_sf_into_required_layout"
    gran = tuple(recipe)
    if len(gran) == 3:
        gran = (gran[0] if is_sfa else gran[1], gran[2])
    if gran != _WEIGHT_RECIPE or disable_ue8m0_cast:
        raise ValueError(
            f"{where}: the stand-in has DeepGEMM's (FP32, 1, 32) -> packed UE8M0 branch only "
            f"(recipe (1, 32), the FP4 weights' scales); got recipe={recipe!r}, "
            f"disable_ue8m0_cast={disable_ue8m0_cast}"
        )
    groups = num_groups if sf.dim() == 3 else None
    want = (*(() if groups is None else (groups,)), mn, -(-k // 32))
    if sf.dtype != torch.float32 or tuple(sf.shape) != want or k % 128:
        raise ValueError(
            f"{where}: sf must be FP32 of shape {want} for mn={mn}, k={k} (k a multiple of "
            f"128), got {sf.dtype} {tuple(sf.shape)}"
        )
    bits = sf.contiguous().view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any() | (sf <= 0).any()):
        raise ValueError(
            f"{where}: every scale must be a positive power of two (UE8M0); the packing keeps "
            "the exponent byte only and would change the others"
        )
    return pack_ue8m0(sf)


def transform_weights_for_mega_moe(
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Upstream's weight transform (L1 gate/up interleaved by 8, both scales in UTCCP order):
    :func:`moewire.reference.deep_gemm.transform_weights_for_mega_moe` on ``(w, sf)`` pairs."""
    return deep_gemm.transform_weights_for_mega_moe(l1_weights, l2_weights)


def fp8_fp4_mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    sym_buffer: SymmBuffer,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    recipe: tuple[int, int, int] = (1, 1, 32),
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
) -> torch.Tensor:
    """Upstream's FP8 x FP4 Mega-MoE over the stand-in kernel; writes and returns ``y``.

    The math is :func:`moewire.reference.deep_gemm.fp8_fp4_mega_moe`'s (no fused shared
    expert: upstream has none). Args as upstream's (module docstring).
    """
    deep_gemm.fp8_fp4_mega_moe(
        y, l1_weights, l2_weights, sym_buffer, recipe=recipe, activation=activation,
        activation_clamp=activation_clamp, fast_math=fast_math,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
    )
    return y
