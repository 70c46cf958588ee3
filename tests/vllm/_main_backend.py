"""A stand-in written to the backend shape of vLLM main's DeepSeek-V4 Mega-MoE experts.

Contract (read, not copied): ``vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py``
at 4083b32 (``DeepGemmMegaMoEBackend``, ``DeepGemmSm100MegaMoEBackend.run_mega_moe``:
keyword-only ``y, l1_weights, l2_weights, symm_buffer, activation_clamp, fast_math``, then
``activation``/``activation_alpha``/``activation_beta`` passed on even when ``None``, and
``shared_l1_weights``/``shared_l2_weights`` when a shared expert is fused; DeepGEMM through
``_import_deep_gemm()`` inside the call) and the forward of vLLM 0.32's
``DeepseekV4MegaMoEExperts`` that calls it (stage with the global ``prepare_megamoe_inputs``,
then ``backend.run_mega_moe``). This module is both the experts' module and, for the tests,
the bridge: ``deep_gemm`` is what ``_import_deep_gemm()`` returns, and moewire's adapter
names it and ``prepare_megamoe_inputs`` (here vLLM's staging in plain torch,
``_standin.prepare_megamoe_inputs_reference``).
"""

from __future__ import annotations

from typing import Any

import torch
from _standin import prepare_megamoe_inputs_reference
from torch import nn

from moewire.reference import deep_gemm as reference
from moewire.reference import get_forward_context, make_weights

deep_gemm: Any = reference
prepare_megamoe_inputs = prepare_megamoe_inputs_reference
#: The kernel the backend calls (a test points it at a fifth, unknown kernel name).
KERNEL = "fp8_fp4_mega_moe"


def _import_deep_gemm() -> Any:
    return globals()["deep_gemm"]


class Sm100Backend:
    """``DeepGemmSm100MegaMoEBackend``'s ``run_mega_moe`` contract (main, 4083b32)."""

    mma_type = "fp8xfp4"
    hidden_quant = "mxfp8"

    def run_mega_moe(
        self, *, y: torch.Tensor, l1_weights: Any, l2_weights: Any, symm_buffer: Any,
        activation_clamp: float | None, fast_math: bool, activation: str | None = None,
        activation_alpha: float | None = None, activation_beta: float | None = None,
        shared_l1_weights: Any = None, shared_l2_weights: Any = None,
    ) -> None:
        dg = _import_deep_gemm()
        kernel = getattr(dg, KERNEL)
        shared = {}
        if shared_l1_weights is not None and shared_l2_weights is not None:
            shared = dict(shared_l1_weights=shared_l1_weights, shared_l2_weights=shared_l2_weights)
        kernel(y, l1_weights, l2_weights, symm_buffer, **shared,
               activation_clamp=activation_clamp, fast_math=fast_math, activation=activation,
               activation_alpha=activation_alpha, activation_beta=activation_beta)


class BackendExperts(nn.Module):
    """DeepSeek-V4's routed experts through a backend (one rank, stand-in kernel).

    Args:
        num_experts, top_k, hidden, intermediate, max_num_tokens: the layer's shape.
        fused_shared: fuse one shared expert into the kernel.
        seed: of the weights.
    """

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_num_tokens: int, *, fused_shared: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden, self.intermediate, self.max_num_tokens = hidden, intermediate, max_num_tokens
        self.fused = fused_shared
        self._backend = Sm100Backend()
        self.weights = make_weights(num_experts, hidden, intermediate,
                                    num_shared_experts=int(fused_shared), seed=seed)
        self._buffer = reference.get_symm_buffer_for_mega_moe(
            None, num_experts, max_num_tokens, top_k, hidden, intermediate,
            num_shared_experts=int(fused_shared), device="cpu")
        self.register_buffer("anchor", torch.zeros(()))

    @property
    def has_fused_shared_experts(self) -> bool:
        return self.fused

    def get_symm_buffer(self) -> Any:
        return self._buffer

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation_clamp: float | None,
                fast_math: bool = True) -> torch.Tensor:
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        dg = _import_deep_gemm()
        num_tokens = hidden_states.shape[0]
        backend = self._backend
        buf = self.get_symm_buffer()
        shared_x_sf = shared_block_m = None
        if self.has_fused_shared_experts:
            shared_x_sf = buf.shared_l1_acts_sf
            shared_block_m = dg.get_block_m_for_mega_moe(
                1, self.num_experts, buf.num_max_tokens_per_rank, num_tokens, self.top_k,
                backend.mma_type)
        prepare_megamoe_inputs(
            hidden_states, topk_weights, topk_ids, buf.x[:num_tokens], buf.x_sf[:num_tokens],
            buf.topk_idx[:num_tokens], buf.topk_weights[:num_tokens],
            is_padding=get_forward_context().is_padding, shared_x_sf=shared_x_sf,
            shared_block_m=shared_block_m, hidden_quant=backend.hidden_quant)
        w = self.weights
        shared = (dict(shared_l1_weights=w.shared_l1, shared_l2_weights=w.shared_l2)
                  if self.has_fused_shared_experts else {})
        backend.run_mega_moe(y=y, l1_weights=w.l1, l2_weights=w.l2, symm_buffer=buf,
                             activation_clamp=activation_clamp, fast_math=fast_math, **shared)
        return y
