"""A vLLM-main-like NVFP4 x NVFP4 Mega-MoE experts module on the stand-in kernel.

:class:`FP4MegaMoEExperts` follows ``DeepseekV32MegaMoEExperts.forward`` of vLLM main
(``vllm/models/deepseek_v32/nvidia/mega_moe.py``, 30a3a7a; DeepSeek V3.2 and GLM-5.2 NVFP4):
check ``T <= max_num_tokens``, read ``is_padding`` from the forward context, stage with the
module global ``prepare_megamoe_nvfp4_inputs`` into the ``fp4xfp4`` buffer, call
``deep_gemm.fp4_fp4_mega_moe(y, l1, l2, buffer, l1_alphas=, l2_alphas=)`` through the module
global ``deep_gemm``. Beyond vLLM's call it can pass the rest of DeepGEMM 2.8.0's API: a
fused BF16 shared expert (``x_bf16`` = the forward's tokens), ``a2_scales`` and
``routed_scaling_factor``; an unfused shared expert is added after the kernel, as vLLM's
MoE block does (``DeepseekV32MegaMoE.forward``).

May import: torch, ``moewire.reference.deep_gemm`` (the API), ``moewire.reference._ep_experts``
and ``moewire.reference.experts`` (the forward context), and the family's package,
``staging`` and ``weights``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moewire.reference import deep_gemm
from moewire.reference._ep_experts import EPExperts
from moewire.reference.experts import padding_rows
from moewire.reference.fp4_fp4 import FLAVOUR
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.fp4_fp4.weights import FP4MegaMoEWeights, make_fp4_fp4_weights

__all__ = ["FP4MegaMoEExperts", "prepare_megamoe_nvfp4_inputs"]


class FP4MegaMoEExperts(EPExperts):
    """NVFP4 x NVFP4 Mega-MoE routed experts of one EP rank, with vLLM main's forward.

    Args:
        num_experts: routed experts over the EP group (split evenly over its ranks).
        top_k: routed slots per token.
        hidden: H; intermediate: I per expert (multiples of 512).
        max_num_tokens: tokens per rank per call (the buffer rounds its capacity up to 1920).
        group: EP process group or None (one rank).
        num_fused_shared_experts: > 0 fuses a BF16 shared expert of ``n * I``.
        activation_clamp: SwiGLU clamp, or None.
        a2_scales: FP32 ``[E_local]`` (the L2 input's global scale per local expert) or None.
        routed_scaling_factor: the kernel's factor of the routed sum.
        weights: this rank's :class:`FP4MegaMoEWeights`; default ``make_fp4_fp4_weights``.
        seed: seed of the default weights.
        device: default CUDA when available and the group is NCCL or None, else CPU.

    The stand-in models this kernel for DeepGEMM 2.8.0 alone: the module builds its buffer
    under that flavour (``deepgemm-2.8``) whatever the stand-in's other kernels imitate.
    """

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, max_num_tokens: int,
        *, group: dist.ProcessGroup | None = None, num_fused_shared_experts: int = 0,
        activation_clamp: float | None = None,
        a2_scales: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0,
        weights: FP4MegaMoEWeights | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(num_experts, top_k, hidden, intermediate, max_num_tokens, group,
                         num_fused_shared_experts)
        where = type(self).__name__
        self.activation_clamp = activation_clamp
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.kernel_name = "fp4_fp4_mega_moe"
        device = self._device(device)

        def build() -> Any:
            with deep_gemm.use_flavour(FLAVOUR):
                return deep_gemm.get_symm_buffer_for_mega_moe(
                    self.ep_group, num_experts, max_num_tokens, top_k, hidden, intermediate,
                    num_shared_experts=num_fused_shared_experts, mma_type="fp4xfp4",
                    device=device,
                )

        self.symm_buffer = self._cached_buffer(("fp4xfp4", device), build)
        if weights is None:
            weights = make_fp4_fp4_weights(
                num_experts, hidden, intermediate, experts=self.local_experts,
                num_shared_experts=num_fused_shared_experts, seed=seed, device=device,
            )
        self._check_experts(weights.experts, "make_fp4_fp4_weights")
        if self.fused_shared != (weights.shared_l1 is not None):
            raise ValueError(
                f"{where}: num_fused_shared_experts={num_fused_shared_experts} does not match "
                "the weights' shared expert; build both with the same count"
            )
        self._register_routed_weights(weights.l1, weights.l2)
        self.register_buffer("l1_alphas", weights.l1_alphas.float().contiguous())
        self.register_buffer("l2_alphas", weights.l2_alphas.float().contiguous())
        self.a2_scales = None if a2_scales is None else a2_scales.float().to(device)
        self.shared_l1_weights: Any = weights.shared_l1
        self.shared_l2_weights: Any = weights.shared_l2

    @property
    def has_fused_shared_experts(self) -> bool:
        return self.fused_shared

    def _routed(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        is_padding = padding_rows(num_tokens)
        buf = self.get_symm_buffer()
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        prepare_megamoe_nvfp4_inputs(
            hidden_states, topk_weights, topk_ids, buf.x[:num_tokens], buf.x_sf[:num_tokens],
            buf.topk_idx[:num_tokens], buf.topk_weights[:num_tokens], is_padding=is_padding,
        )
        shared: dict[str, Any] = {}
        if self.fused_shared:
            shared = {**self._fused_shared_kwargs(), "x_bf16": hidden_states.bfloat16()}
        getattr(deep_gemm, self.kernel_name)(
            y, self.l1_weights, self.l2_weights, buf, activation_clamp=self.activation_clamp,
            l1_alphas=self.l1_alphas, l2_alphas=self.l2_alphas, a2_scales=self.a2_scales,
            routed_scaling_factor=self.routed_scaling_factor, **shared,
        )
        return y
