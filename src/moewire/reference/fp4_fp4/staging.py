"""vLLM main's staging of the NVFP4 x NVFP4 Mega-MoE, in torch:
:func:`prepare_megamoe_nvfp4_inputs` of ``vllm/models/deepseek_v32/nvidia/ops/
prepare_megamoe_nvfp4.py`` (05be1d5), which ``DeepseekV32MegaMoEExperts.forward``
(``vllm/models/deepseek_v32/nvidia/mega_moe.py``, 30a3a7a) calls before
``deep_gemm.fp4_fp4_mega_moe``.

May import: torch and the family's ``_numerics``.
"""

from __future__ import annotations

import torch

from moewire.reference.fp4_fp4._numerics import stage_nvfp4_tokens

__all__ = ["BLOCK_K", "prepare_megamoe_nvfp4_inputs"]

#: vLLM's staging kernel takes 256 hidden columns per program and refuses other sizes.
BLOCK_K = 256


def prepare_megamoe_nvfp4_inputs(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    x_fp4: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx_out: torch.Tensor,
    topk_weights_out: torch.Tensor,
    is_padding: torch.Tensor | None = None,
) -> None:
    """Stage ``T`` tokens into an ``fp4xfp4`` buffer's views, as vLLM main does.

    Writes ``x_fp4`` and ``x_sf`` (NVFP4 per 16 elements, no global scale:
    :func:`~moewire.reference.fp4_fp4._numerics.stage_nvfp4_tokens`), ``topk_idx_out`` (int64,
    ``-1`` for a padding token) and ``topk_weights_out`` (FP32, 0 for a padding token). Does
    nothing for ``T = 0`` (as vLLM: it returns before any check).

    Args:
        hidden_states: floating ``[T, H]`` (BF16 in vLLM), ``H`` a multiple of 256.
        topk_weights, topk_ids: ``[T, k]`` each.
        x_fp4: uint8/int8 ``[T, H/2]``; x_sf: int32 ``[T, H/64]``.
        topk_idx_out: int64 ``[T, k]``; topk_weights_out: FP32 ``[T, k]``.
        is_padding: bool ``[>= T]`` or None.

    Raises:
        ValueError: ``H`` is not a multiple of 256, or the top-k tensors differ in shape
            (vLLM's two checks).
    """
    num_tokens, hidden = hidden_states.shape
    if num_tokens == 0:
        return
    if hidden % BLOCK_K:
        raise ValueError(
            "prepare_megamoe_nvfp4_inputs: NVFP4 MegaMoE input staging requires hidden_size "
            f"to be a multiple of {BLOCK_K}, got {hidden}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            "prepare_megamoe_nvfp4_inputs: topk_weights and topk_ids must have the same shape, "
            f"got {tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}"
        )
    packed, sf = stage_nvfp4_tokens(hidden_states)
    x_fp4.copy_(packed.view(x_fp4.dtype))
    x_sf.copy_(sf)
    ids, weights = topk_ids.to(torch.int64), topk_weights.float()
    if is_padding is not None:
        pad = is_padding[:num_tokens].to(device=ids.device, dtype=torch.bool).unsqueeze(1)
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
        weights = torch.where(pad, torch.zeros_like(weights), weights)
    topk_idx_out.copy_(ids)
    topk_weights_out.copy_(weights)
