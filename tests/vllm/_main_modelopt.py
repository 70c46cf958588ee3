"""A stand-in written to vLLM main's ModelOpt NVFP4 Mega-MoE quant method.

Contract (read, not copied): ``vllm/model_executor/layers/quantization/modelopt.py`` of a
stored vLLM main version, ``ModelOptNvFp4MegaMoE``: a quant method (no ``nn.Module``) held by
the MoE layer (``RoutedExperts.quant_method``). ``process_weights_after_loading(layer)`` gets
DeepGEMM from ``_import_deep_gemm()``, transforms the NVFP4 weights, sets the layer's
``_deep_gemm_mega_l1_alphas = w13_weight_scale_2 * a1_scale`` (``a1_scale`` the max
``w13_input_scale``), ``_deep_gemm_mega_a1_gscale = 1 / a1_scale``, ``_deep_gemm_mega_a2_scales``
(the max ``w2_input_scale`` per local expert), and builds ``self._symm_buffer =
deep_gemm.get_symm_buffer_for_mega_moe(ep group, ..., num_shared_experts=, mma_type=
"fp4xfp4")`` and ``self._deep_gemm``. ``apply(layer, x, topk_weights, topk_ids,
shared_experts, shared_experts_input)`` stages with the module global
``prepare_nvfp4_megamoe_inputs(x, layer._deep_gemm_mega_a1_gscale, topk_weights, topk_ids,
buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, is_padding=)`` and calls
``self._deep_gemm.fp4_fp4_mega_moe(y, l1, l2, buf, activation_clamp=, fast_math=True,
l1_alphas=, l2_alphas=, a2_scales=, routed_scaling_factor=(rsf if a shared expert is fused
else 1.0), shared_l1_weights=, shared_l2_weights=, x_bf16=shared_experts_input)``;
``mk_fuses_shared_experts`` says whether it fuses the BF16 shared expert. :class:`MoELayer`
stands in for ``RoutedExperts``.

The staging divides exactly where vLLM's Triton op (``fused_moe/prepare_megamoe.py``) takes
``rcp.approx`` (no check of moewire depends on the staged bytes' last bit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moewire.reference import deep_gemm as reference
from moewire.reference import get_forward_context
from moewire.reference._numerics import quantize_e2m1
from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights
from moewire.reference.nvfp4._numerics import e4m3, pack_e4m3, pack_fp4_codes

deep_gemm: Any = reference


def _import_deep_gemm() -> Any:
    return globals()["deep_gemm"]


def prepare_nvfp4_megamoe_inputs(hidden_states, input_global_scale, topk_weights, topk_ids,
                                 x_fp4, x_sf, topk_idx_out, topk_weights_out,
                                 is_padding=None) -> None:
    """NVFP4 per 16 with a global scale ``g``: ``sf = e4m3(g * amax / 6)``, ``code =
    e2m1(x / (sf / g))``; padding tokens get id -1 and weight 0."""
    t = hidden_states.shape[0]
    if t == 0:
        return
    g = input_global_scale.float()
    groups = hidden_states.float().unflatten(-1, (-1, 16))
    sf = e4m3(g * groups.abs().amax(dim=-1, keepdim=True) * (1.0 / 6.0))
    codes = quantize_e2m1(torch.where(sf == 0, 0.0, groups / (sf / g))).flatten(-2)
    x_fp4.copy_(pack_fp4_codes(codes).view(torch.uint8))
    x_sf.copy_(pack_e4m3(sf.squeeze(-1)))
    ids, weights = topk_ids.long(), topk_weights.float()
    if is_padding is not None:
        pad = is_padding[:t].unsqueeze(1)
        ids, weights = ids.masked_fill(pad, -1), weights.masked_fill(pad, 0.0)
    topk_idx_out.copy_(ids)
    topk_weights_out.copy_(weights)


class ModelOptNvFp4MegaMoE:
    """ModelOpt NVFP4 quant method on DeepGEMM's NVFP4 x NVFP4 Mega-MoE (one rank)."""

    def __init__(self, shared: bool, routed_scaling_factor: float) -> None:
        self._shared = shared
        self._routed_scaling_factor = routed_scaling_factor
        self._shared_l1_weights: Any = None
        self._shared_l2_weights: Any = None
        self._deep_gemm: Any = None
        self._symm_buffer: Any = None

    @property
    def mk_fuses_shared_experts(self) -> bool:
        return self._shared

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        deep_gemm = _import_deep_gemm()
        w = make_fp4_fp4_weights(layer.num_experts, layer.hidden, layer.inter,
                                 num_shared_experts=int(self._shared), seed=7)
        a1_scale = torch.tensor(0.02)
        layer._deep_gemm_mega_l1_weights, layer._deep_gemm_mega_l2_weights = w.l1, w.l2
        layer._deep_gemm_mega_a1_gscale = a1_scale.reciprocal()
        layer._deep_gemm_mega_l1_alphas = w.l1_alphas * a1_scale
        layer._deep_gemm_mega_l2_alphas = w.l2_alphas
        layer._deep_gemm_mega_a2_scales = torch.full_like(w.l2_alphas, 0.37)
        self._shared_l1_weights, self._shared_l2_weights = w.shared_l1, w.shared_l2
        self._symm_buffer = deep_gemm.get_symm_buffer_for_mega_moe(
            None, layer.num_experts, layer.max_num_tokens, layer.top_k, layer.hidden,
            layer.inter, num_shared_experts=int(self._shared), mma_type="fp4xfp4",
            device="cpu")
        self._deep_gemm = deep_gemm

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts: Any,
              shared_experts_input: torch.Tensor | None) -> torch.Tensor:
        num_tokens = x.shape[0]
        symm_buffer = self._symm_buffer
        is_padding = get_forward_context().is_padding
        if is_padding is not None:
            is_padding = is_padding[:num_tokens]
        prepare_nvfp4_megamoe_inputs(
            x, layer._deep_gemm_mega_a1_gscale, topk_weights, topk_ids,
            symm_buffer.x[:num_tokens], symm_buffer.x_sf[:num_tokens],
            symm_buffer.topk_idx[:num_tokens], symm_buffer.topk_weights[:num_tokens],
            is_padding=is_padding)
        y = torch.empty_like(x)
        shared_kwargs = {}
        if self._shared:
            shared_kwargs = {"shared_l1_weights": self._shared_l1_weights,
                             "shared_l2_weights": self._shared_l2_weights,
                             "x_bf16": shared_experts_input}
        self._deep_gemm.fp4_fp4_mega_moe(
            y, layer._deep_gemm_mega_l1_weights, layer._deep_gemm_mega_l2_weights,
            symm_buffer, activation_clamp=None, fast_math=True,
            l1_alphas=layer._deep_gemm_mega_l1_alphas, l2_alphas=layer._deep_gemm_mega_l2_alphas,
            a2_scales=layer._deep_gemm_mega_a2_scales,
            routed_scaling_factor=self._routed_scaling_factor if self._shared else 1.0,
            **shared_kwargs)
        return y


class MoELayer(nn.Module):
    """vLLM's ``RoutedExperts``, reduced to what holds the quant method and calls ``apply``."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int,
                 max_num_tokens: int, *, shared: bool = False,
                 routed_scaling_factor: float = 2.5) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.hidden, self.inter = num_experts, top_k, hidden, inter
        self.max_num_tokens = max_num_tokens
        self.quant_method = ModelOptNvFp4MegaMoE(shared, routed_scaling_factor)
        self.quant_method.process_weights_after_loading(self)
        self.register_buffer("anchor", torch.zeros(()))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, topk_weights, topk_ids, None, x)
