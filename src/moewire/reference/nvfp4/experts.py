"""A vLLM-like NVFP4 Mega-MoE experts module on top of the stand-in NVFP4 kernel.

:class:`NVFP4MegaMoEExperts` follows the NVFP4 branch of vLLM 0.34's
``DeepGemmMegaMoEExperts.forward`` (``model_executor/layers/fused_moe/deep_gemm_mega_moe.py``,
``fmt.uses_nvfp4_api``; 0.33's is the same without ``eplb_state``): check ``T <=
max_num_tokens``, read ``is_padding`` from the forward context, stage with the module
global ``prepare_megamoe_nvfp4_inputs`` (per-token NVFP4 tokens, a fused shared expert's
MXFP8 or BF16 input, ``l2_alpha = w2_weight_scale_2 * l2_activation_scale``), call
``deep_gemm.nvfp4_mega_moe`` through the module global ``deep_gemm`` with
``l1_alpha = w13_weight_scale_2`` and ``use_x_scales=True``, then add an unfused shared
expert. Those two globals are where a quantization wrapper interposes.

May import: torch, ``moewire.reference.deep_gemm`` (the API), ``moewire.reference._ep_experts``
and ``moewire.reference.experts`` (the forward context), and the family's ``staging`` and
``weights``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moewire.reference import deep_gemm
from moewire.reference._ep_experts import EPExperts
from moewire.reference.experts import padding_rows
from moewire.reference.nvfp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.nvfp4.weights import NVFP4MegaMoEWeights, make_nvfp4_weights

__all__ = ["NVFP4MegaMoEExperts", "prepare_megamoe_nvfp4_inputs"]

# The build that has nvfp4_mega_moe (vLLM 0.33/0.34's bundled DeepGEMM).
NVFP4_FLAVOUR = "vllm-0.33"


class NVFP4MegaMoEExperts(EPExperts):
    """NVFP4 Mega-MoE routed experts of one EP rank, with vLLM's forward contract.

    Args:
        num_experts: routed experts over the EP group (split evenly over its ranks).
        top_k: routed slots per token.
        hidden: H; intermediate: I per expert (multiples of 128).
        max_num_tokens: tokens per rank per call (the buffer rounds its capacity up to 384).
        group: EP process group or None (one rank).
        num_fused_shared_experts: > 0 fuses a shared expert of ``n * I`` into the kernel.
        shared_dtype: the fused shared expert's precision, ``torch.float8_e4m3fn`` (MXFP8)
            or ``torch.bfloat16``.
        activation_clamp: SwiGLU clamp, or None.
        l2_activation_scale: the global scale of the routed L2 input (vLLM: the max
            ``w2_input_scale`` over the experts).
        weights: this rank's :class:`NVFP4MegaMoEWeights`; default
            ``make_nvfp4_weights(seed=seed)`` for the local experts.
        seed: seed of the default weights.
        device: default CUDA when available and the group is NCCL or None, else CPU.

    The stand-in's DeepGEMM must imitate the build that has this kernel:
    ``deep_gemm.use_flavour("vllm-0.33")`` (the default).
    """

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, max_num_tokens: int,
        *, group: dist.ProcessGroup | None = None, num_fused_shared_experts: int = 0,
        shared_dtype: torch.dtype = torch.float8_e4m3fn,
        activation_clamp: float | None = None,
        l2_activation_scale: float = 1.0,
        weights: NVFP4MegaMoEWeights | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        where = type(self).__name__
        flavour = deep_gemm.moewire_flavour()
        if flavour != NVFP4_FLAVOUR:
            raise ValueError(
                f"{where}: nvfp4_mega_moe exists only in the DeepGEMM bundled in vLLM "
                f"0.33/0.34, but the stand-in imitates {flavour!r} now; select it with "
                f"deep_gemm.use_flavour({NVFP4_FLAVOUR!r})"
            )
        super().__init__(num_experts, top_k, hidden, intermediate, max_num_tokens, group,
                         num_fused_shared_experts)
        self.shared_dtype = shared_dtype
        self.activation_clamp = activation_clamp
        self.l2_activation_scale = float(l2_activation_scale)
        self.kernel_name = "nvfp4_mega_moe"
        device = self._device(device)
        self.symm_buffer = self._build_symm_buffer(device)
        if weights is None:
            weights = make_nvfp4_weights(
                num_experts, hidden, intermediate, experts=self.local_experts,
                num_shared_experts=num_fused_shared_experts, shared_dtype=shared_dtype,
                seed=seed, device=device,
            )
        self._check_experts(weights.experts, "make_nvfp4_weights")
        if self.fused_shared != (weights.shared_l1 is not None) or (
            self.fused_shared and weights.shared_dtype != shared_dtype
        ):
            raise ValueError(
                f"{where}: num_fused_shared_experts={num_fused_shared_experts} with "
                f"shared_dtype={shared_dtype} does not match the weights' shared expert "
                f"({weights.shared_dtype})"
            )
        self._register_routed_weights(weights.l1, weights.l2)
        self.register_buffer("w13_weight_scale_2", weights.l1_global_scale.float())
        self.register_buffer("w2_weight_scale_2", weights.l2_global_scale.float())
        self.register_buffer(
            "_l2_alpha", torch.zeros(self.num_local_experts, device=device), persistent=False
        )
        self.shared_l1_weights: Any = weights.shared_l1
        self.shared_l2_weights: Any = weights.shared_l2

    def _build_symm_buffer(self, device: torch.device) -> deep_gemm.NVFP4SymmBuffer:
        # Keyed like vLLM's cache (EP group, shapes, shared count and dtype).
        return self._cached_buffer(
            (self.shared_dtype, "nvfp4", device),
            lambda: deep_gemm.NVFP4SymmBuffer(
                self.ep_group, self.num_experts, self.max_num_tokens, self.top_k,
                self.hidden, self.intermediate,
                num_shared_experts=self.num_fused_shared_experts,
                shared_dtype=self.shared_dtype, device=device,
            ),
        )

    def _routed(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        is_padding = padding_rows(num_tokens)
        buf = self.get_symm_buffer()
        shared_x_sf = shared_block_m = None
        if self.fused_shared and buf.shared_with_sf:
            shared_x_sf = buf.shared_l1_acts_sf
            shared_block_m = deep_gemm.get_block_m_for_nvfp4_mega_moe(
                self.ep_size, self.num_experts, buf.num_max_tokens_per_rank, num_tokens,
                self.top_k,
            )
        prepare_megamoe_nvfp4_inputs(
            hidden_states, topk_weights, topk_ids, buf.x[:num_tokens], buf.x_sf[:num_tokens],
            buf.x_scales[:num_tokens], buf.topk_idx[:num_tokens],
            buf.topk_weights[:num_tokens], is_padding=is_padding,
            shared_x=buf.shared_l1_acts[:num_tokens] if self.fused_shared else None,
            shared_x_sf=shared_x_sf, shared_block_m=shared_block_m,
            w2_global_scale=self.w2_weight_scale_2, l2_alpha=self._l2_alpha,
            l2_activation_scale=self.l2_activation_scale,
        )
        kwargs: dict[str, Any] = {
            "activation_clamp": self.activation_clamp, "l1_alpha": self.w13_weight_scale_2,
            "l2_alpha": self._l2_alpha, "l2_activation_scale": self.l2_activation_scale,
            "use_x_scales": True, **self._fused_shared_kwargs(),
        }
        y = torch.empty((num_tokens, self.hidden), dtype=torch.bfloat16,
                        device=hidden_states.device)
        getattr(deep_gemm, self.kernel_name)(
            y, self.l1_weights, self.l2_weights, buf, fast_math=True, **kwargs
        )
        return y
