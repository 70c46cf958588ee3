"""An experts module written to vLLM main's ``DeepseekV32MegaMoEExperts`` contract.

vLLM main's NVFP4 x NVFP4 Mega-MoE experts (``vllm/models/deepseek_v32/nvidia/mega_moe.py``,
stored commit 30a3a7a; DeepSeek V3.2 and GLM-5.2 NVFP4) need a vLLM newer than the 0.32
installed here and an SM100 GPU. This module (moewire's own code) keeps the parts of that
contract moewire depends on, with vLLM 0.32's helpers where main's are the same:

- the buffer comes from ``deep_gemm.get_symm_buffer_for_mega_moe(ep group, E,
  max_num_batched_tokens, k, H, I, mma_type="fp4xfp4")``, cached per (group, device, shape)
  in a class dict;
- the forward checks ``T <= max_num_tokens``, reaches DeepGEMM through a call-time
  ``from vllm.utils.deep_gemm import _import_deep_gemm``, reads ``is_padding`` from vLLM's
  forward context when ``VLLM_MOE_SKIP_PADDING`` is set, stages with the module global
  ``prepare_megamoe_nvfp4_inputs(hidden_states, topk_weights, topk_ids, x, x_sf, topk_idx,
  topk_weights, is_padding=)`` (main's Triton op, 05be1d5; here the stand-in's torch copy)
  and calls ``deep_gemm.fp4_fp4_mega_moe(y, l1, l2, symm_buffer, l1_alphas=, l2_alphas=)``;
  no fused shared expert (the MoE block adds it after the experts).

The weights are the stand-in's seeded ModelOpt-style NVFP4 (``make_fp4_fp4_weights``)
instead of a checkpoint's; the tests load this file under main's module name.
"""

from __future__ import annotations

from typing import Any

import torch
import vllm.envs as envs
from torch import nn
from vllm.distributed import get_ep_group
from vllm.forward_context import get_forward_context, is_forward_context_available

from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights

__all__ = ["DeepseekV32MegaMoEExperts", "prepare_megamoe_nvfp4_inputs"]


class DeepseekV32MegaMoEExperts(nn.Module):
    """Routed experts on DeepGEMM's NVFP4 x NVFP4 Mega-MoE kernel (vLLM main's contract)."""

    _symm_buffer_cache: dict[tuple, Any] = {}

    def __init__(self, vllm_config: Any, *, num_experts: int, num_local_experts: int,
                 experts_start_idx: int, top_k: int, hidden_size: int, intermediate_size: int,
                 prefix: str = "", seed: int = 0) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        weights = make_fp4_fp4_weights(
            num_experts, hidden_size, intermediate_size,
            experts=range(experts_start_idx, experts_start_idx + num_local_experts), seed=seed,
        )
        self._transformed_l1_weights = weights.l1
        self._transformed_l2_weights = weights.l2
        self._l1_alphas = weights.l1_alphas.contiguous()
        self._l2_alphas = weights.l2_alphas.contiguous()
        self.register_buffer("anchor", torch.zeros(()))

    def get_symm_buffer(self) -> Any:
        from vllm.utils.deep_gemm import _import_deep_gemm

        deep_gemm = _import_deep_gemm()
        group = get_ep_group().device_group
        key = (group, self.num_experts, self.max_num_tokens, self.top_k, self.hidden_size,
               self.intermediate_size)
        symm_buffer = self._symm_buffer_cache.get(key)
        if symm_buffer is None:
            symm_buffer = deep_gemm.get_symm_buffer_for_mega_moe(
                group, self.num_experts, self.max_num_tokens, self.top_k, self.hidden_size,
                self.intermediate_size, mma_type="fp4xfp4",
            )
            self._symm_buffer_cache[key] = symm_buffer
        return symm_buffer

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] > self.max_num_tokens:
            raise ValueError(
                f"NVFP4 MegaMoE got {hidden_states.shape[0]} tokens, but the symmetric buffer "
                f"was sized for {self.max_num_tokens}."
            )
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)

        from vllm.utils.deep_gemm import _import_deep_gemm

        deep_gemm = _import_deep_gemm()
        symm_buffer = self.get_symm_buffer()
        num_tokens = hidden_states.shape[0]
        is_padding = None
        if envs.VLLM_MOE_SKIP_PADDING and is_forward_context_available():
            is_padding = get_forward_context().is_padding
            if is_padding is not None:
                is_padding = is_padding[:num_tokens]
        prepare_megamoe_nvfp4_inputs(
            hidden_states, topk_weights, topk_ids, symm_buffer.x[:num_tokens],
            symm_buffer.x_sf[:num_tokens], symm_buffer.topk_idx[:num_tokens],
            symm_buffer.topk_weights[:num_tokens], is_padding=is_padding,
        )
        deep_gemm.fp4_fp4_mega_moe(
            y, self._transformed_l1_weights, self._transformed_l2_weights, symm_buffer,
            l1_alphas=self._l1_alphas, l2_alphas=self._l2_alphas,
        )
        return y
