"""A stand-in written to vLLM main's common Mega-MoE experts contract.

Contract (read, not copied): ``vllm/models/common/deep_gemm_mega_moe.py`` at 6dfb263,
``DeepGemmMegaMoEExperts.forward``: ``y = torch.empty_like(hidden_states, dtype=bf16)``;
DeepGEMM through ``_import_deep_gemm()`` inside the forward; ``mma_type="bf16xbf16"``
stages with a plain copy (``symm_buffer.x[:n].copy_(hidden_states)``, then the ids and
weights), ``"fp8xfp4"`` with the global ``prepare_megamoe_inputs(hidden_states, topk_weights,
topk_ids, x, x_sf, topk_idx, topk_weights, is_padding=, shared_x_sf=, shared_block_m=)``;
the kernel is a local name, ``kernel = deep_gemm.bf16_mega_moe if ... else
deep_gemm.fp8_fp4_mega_moe``, called ``kernel(y, l1, l2, symm_buffer, activation_clamp=,
fast_math=)``. This module is both the experts' module and, for the tests, the bridge:
``deep_gemm`` is what ``_import_deep_gemm()`` returns (the stand-in kernel).

``DeepseekV32MegaMoEExperts`` is written to vLLM main's NVFP4 x NVFP4 experts
(``vllm/models/deepseek_v32/nvidia/mega_moe.py``, 30a3a7a), staging with vLLM main's
``prepare_megamoe_nvfp4_inputs`` (the stand-in's torch copy, ``reference.fp4_fp4.staging``)
into the ``fp4xfp4`` buffer of DeepGEMM 2.8.0's stand-in.

``ResidualExperts`` breaks the contract on purpose: its forward also adds ``hidden_states``
to ``y``, so quantizing the argument would change more than the staged tokens.
``TwiceStagedExperts`` copies and then also calls the staging function.
"""

from __future__ import annotations

from typing import Any

import torch
from _standin import prepare_megamoe_inputs_reference
from torch import nn

from moewire.reference import deep_gemm as reference
from moewire.reference import get_forward_context, make_weights
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights

deep_gemm: Any = reference
prepare_megamoe_inputs = prepare_megamoe_inputs_reference


def _import_deep_gemm() -> Any:
    return globals()["deep_gemm"]


class DeepGemmMegaMoEExperts(nn.Module):
    """vLLM main's common experts (one rank, stand-in kernel, no fused shared expert)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_num_tokens: int, *, mma_type: str = "fp8xfp4", seed: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.mma_type = num_experts, top_k, mma_type
        self.weights = make_weights(num_experts, hidden, intermediate, mma_type=mma_type,
                                    seed=seed)
        self._buffer = reference.get_symm_buffer_for_mega_moe(
            None, num_experts, max_num_tokens, top_k, hidden, intermediate,
            mma_type=mma_type, device="cpu")
        self.register_buffer("anchor", torch.zeros(()))

    @property
    def has_fused_shared_experts(self) -> bool:
        return False

    def get_symm_buffer(self) -> Any:
        return self._buffer

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation_clamp: float | None,
                fast_math: bool = True) -> torch.Tensor:
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        deep_gemm = _import_deep_gemm()
        symm_buffer = self.get_symm_buffer()
        num_tokens = hidden_states.shape[0]
        if self.mma_type == "bf16xbf16":
            symm_buffer.x[:num_tokens].copy_(hidden_states)
            symm_buffer.topk_idx[:num_tokens].copy_(topk_ids)
            symm_buffer.topk_weights[:num_tokens].copy_(topk_weights)
        else:
            prepare_megamoe_inputs(
                hidden_states, topk_weights, topk_ids, symm_buffer.x[:num_tokens],
                symm_buffer.x_sf[:num_tokens], symm_buffer.topk_idx[:num_tokens],
                symm_buffer.topk_weights[:num_tokens], is_padding=None, shared_x_sf=None,
                shared_block_m=None)
        kernel = (
            deep_gemm.bf16_mega_moe if self.mma_type == "bf16xbf16" else deep_gemm.fp8_fp4_mega_moe
        )
        w = self.weights
        kernel(y, w.l1, w.l2, symm_buffer, activation_clamp=activation_clamp,
               fast_math=fast_math)
        return y


class ResidualExperts(DeepGemmMegaMoEExperts):
    """Breaks the plain-copy proof: ``hidden_states`` also feeds ``y``."""

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation_clamp: float | None,
                fast_math: bool = True) -> torch.Tensor:
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        deep_gemm = _import_deep_gemm()
        symm_buffer = self.get_symm_buffer()
        num_tokens = hidden_states.shape[0]
        symm_buffer.x[:num_tokens].copy_(hidden_states)
        symm_buffer.topk_idx[:num_tokens].copy_(topk_ids)
        symm_buffer.topk_weights[:num_tokens].copy_(topk_weights)
        w = self.weights
        deep_gemm.bf16_mega_moe(y, w.l1, w.l2, symm_buffer, activation_clamp=activation_clamp)
        return y + hidden_states


class TwiceStagedExperts(DeepGemmMegaMoEExperts):
    """Copies the tokens and then also calls the staging function in one forward."""

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation_clamp: float | None,
                fast_math: bool = True) -> torch.Tensor:
        symm_buffer = self.get_symm_buffer()
        num_tokens = hidden_states.shape[0]
        symm_buffer.x[:num_tokens].copy_(hidden_states)
        prepare_megamoe_inputs(
            hidden_states, topk_weights, topk_ids, symm_buffer.x[:num_tokens], None,
            symm_buffer.topk_idx[:num_tokens], symm_buffer.topk_weights[:num_tokens])
        return torch.empty_like(hidden_states, dtype=torch.bfloat16)


class DeepseekV32MegaMoEExperts(nn.Module):
    """vLLM main's NVFP4 x NVFP4 experts' forward (``vllm/models/deepseek_v32/nvidia/
    mega_moe.py``, 30a3a7a) on the stand-in's ``fp4xfp4`` buffer (build it under the
    ``deepgemm-2.8`` flavour): ``is_padding`` from the forward context, the staging global
    ``prepare_megamoe_nvfp4_inputs`` (vLLM main's, 05be1d5), then
    ``deep_gemm.fp4_fp4_mega_moe(y, l1, l2, buf, l1_alphas=, l2_alphas=)``; no fused shared
    expert (the MoE block adds the shared expert after the experts)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_num_tokens: int, *, seed: int = 0) -> None:
        super().__init__()
        self.max_num_tokens = max_num_tokens
        weights = make_fp4_fp4_weights(num_experts, hidden, intermediate, seed=seed)
        self._transformed_l1_weights, self._transformed_l2_weights = weights.l1, weights.l2
        self._l1_alphas, self._l2_alphas = weights.l1_alphas, weights.l2_alphas
        self._buffer = reference.get_symm_buffer_for_mega_moe(
            None, num_experts, max_num_tokens, top_k, hidden, intermediate,
            mma_type="fp4xfp4", device="cpu")
        self.register_buffer("anchor", torch.zeros(()))

    def get_symm_buffer(self) -> Any:
        return self._buffer

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] > self.max_num_tokens:
            raise ValueError("NVFP4 MegaMoE got more tokens than the buffer was sized for")
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        deep_gemm = _import_deep_gemm()
        symm_buffer = self.get_symm_buffer()
        num_tokens = hidden_states.shape[0]
        is_padding = get_forward_context().is_padding
        if is_padding is not None:
            is_padding = is_padding[:num_tokens]
        prepare_megamoe_nvfp4_inputs(
            hidden_states, topk_weights, topk_ids, symm_buffer.x[:num_tokens],
            symm_buffer.x_sf[:num_tokens], symm_buffer.topk_idx[:num_tokens],
            symm_buffer.topk_weights[:num_tokens], is_padding=is_padding)
        deep_gemm.fp4_fp4_mega_moe(y, self._transformed_l1_weights,
                                   self._transformed_l2_weights, symm_buffer,
                                   l1_alphas=self._l1_alphas, l2_alphas=self._l2_alphas)
        return y
