"""A stand-in written to gpt-oss's modular Mega-MoE experts of vLLM main.

Contract (read, not copied): ``vllm/model_executor/layers/fused_moe/experts/
deep_gemm_mega_moe.py`` at 13f9685, ``DeepGemmMegaExperts``: a modular experts object (no
``nn.Module``) whose ``__init__`` allocates ``self.buffer = deep_gemm.
get_symm_buffer_for_mega_moe(dp_group, E, T, k, H, I)`` and whose ``apply(output,
hidden_states, w1, w2, topk_weights, topk_ids, ...)`` does ``import deep_gemm``, casts with
``deep_gemm.utils.per_token_cast_to_fp8(hidden_states, use_ue8m0=True, gran_k=32,
use_packed_ue8m0=True)``, copies into ``self.buffer.x``/``x_sf``/``topk_idx``/
``topk_weights`` and calls ``deep_gemm.fp8_fp4_mega_moe(output, (w1, self.w1_scale), (w2,
self.w2_scale), self.buffer)``. vLLM's MoE layer holds it at
``quant_method.moe_kernel.fused_experts``; :class:`MoELayer` stands in for that layer.

``deep_gemm`` here is what vLLM's ``_import_deep_gemm()`` returns (the bridge's global);
the tests make ``import deep_gemm`` give the same module object, as on a machine where
vLLM imports the installed DeepGEMM.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from moewire.reference import deep_gemm as reference
from moewire.reference import make_weights

deep_gemm: Any = reference


class DeepGemmMegaExperts:
    """gpt-oss's modular experts, MXFP4 weights (one rank, stand-in kernel)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_num_tokens: int) -> None:
        import deep_gemm

        self.buffer = deep_gemm.get_symm_buffer_for_mega_moe(
            None, num_experts, max_num_tokens, top_k, hidden, intermediate, device="cpu")

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        import deep_gemm

        num_tokens = hidden_states.shape[0]
        tokens_fp8, tokens_sf = deep_gemm.utils.per_token_cast_to_fp8(
            hidden_states, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        self.buffer.x[:num_tokens].copy_(tokens_fp8)
        self.buffer.x_sf[:num_tokens].copy_(tokens_sf)
        self.buffer.topk_idx[:num_tokens].copy_(topk_ids)
        self.buffer.topk_weights[:num_tokens].copy_(topk_weights)
        deep_gemm.fp8_fp4_mega_moe(output, (w1, self.w1_scale), (w2, self.w2_scale), self.buffer)


class MoELayer(nn.Module):
    """vLLM's MoE layer, reduced to what holds the modular experts and calls ``apply``."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_num_tokens: int, *, seed: int = 0, mega: bool = True) -> None:
        super().__init__()
        weights = make_weights(num_experts, hidden, intermediate, seed=seed)
        experts = DeepGemmMegaExperts(num_experts, top_k, hidden, intermediate, max_num_tokens)
        experts.w1_scale, experts.w2_scale = weights.l1[1], weights.l2[1]
        self.register_buffer("w13_weight", weights.l1[0])
        self.register_buffer("w2_weight", weights.l2[0])
        fused = experts if mega else object()
        self.quant_method = types.SimpleNamespace(
            moe_kernel=types.SimpleNamespace(fused_experts=fused))

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        self.quant_method.moe_kernel.fused_experts.apply(
            output, hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return output
