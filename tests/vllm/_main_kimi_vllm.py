"""Kimi-K3's Mega-MoE experts written to vLLM main's contract, on vLLM 0.32's real base class.

Contract (read, not copied): ``vllm/models/kimi_k3/nvidia/model.py`` at ed51064 (006193b's
experts class is the same), ``KimiK3MegaMoEExperts(DeepseekV4MegaMoEExperts)``: SiTU kwargs
``activation``, ``activation_beta``, ``activation_linear_beta``; its own buffer cache keyed by
group, device, shapes and activation; one accelerator sync and EP CPU-group barrier before
the first launch per (group, device); weights packed by DeepGEMM's
``transform_weights_for_mega_moe(..., activation=...)`` after
``transform_sf_into_required_layout``; a forward that stages with the module global
``prepare_megamoe_inputs`` and calls ``_import_deep_gemm().fp8_fp4_mega_moe`` itself, passing
``activation_beta``/``activation_linear_beta`` (vllm-project/DeepGEMM's 2.6.1 SiTU spelling).
The base class (real ``__init__``, weight parameters, EPLB state, capability check) is the one
vLLM 0.32 installs. The tests load this file under another module name and register it
through moewire's site entry for main's path (``experts_sites((site,))``).
"""

from __future__ import annotations

import torch
import vllm.envs as envs
from vllm.distributed import get_ep_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MegaMoEExperts
from vllm.models.deepseek_v4.nvidia.ops.prepare_megamoe import prepare_megamoe_inputs


class KimiK3MegaMoEExperts(DeepseekV4MegaMoEExperts):
    """Kimi-K3's routed experts on DeepGEMM (vLLM main's shape)."""

    _kimi_symm_buffer_cache: dict[tuple[object, ...], object] = {}
    _synchronized_ep_groups: set[tuple[int, int]] = set()

    def __init__(self, *args, activation: str, activation_beta: float | None,
                 activation_linear_beta: float | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.activation = activation
        self.activation_beta = activation_beta
        self.activation_linear_beta = activation_linear_beta

    def synchronize_first_launch(self) -> None:
        group = get_ep_group()
        key = (id(group.cpu_group), torch.accelerator.current_device_index())
        if key not in self._synchronized_ep_groups:
            torch.accelerator.synchronize()
            torch.distributed.barrier(group=group.cpu_group)
            self._synchronized_ep_groups.add(key)

    def finalize_weights(self) -> None:
        if self._transformed_l1_weights is not None:
            return
        self._check_runtime_supported()
        from vllm.utils.deep_gemm import _import_deep_gemm

        deep_gemm = _import_deep_gemm()
        scales = []
        for scale, mn, k in ((self.w13_weight_scale, 2 * self.intermediate_size,
                              self.hidden_size),
                             (self.w2_weight_scale, self.hidden_size, self.intermediate_size)):
            scales.append(deep_gemm.transform_sf_into_required_layout(
                self._ue8m0_uint8_to_float(scale.data).contiguous(), mn, k, (1, 32),
                self.num_local_experts))
        self._transformed_l1_weights, self._transformed_l2_weights = (
            deep_gemm.transform_weights_for_mega_moe(
                (self.w13_weight.data.view(torch.int8).contiguous(), scales[0]),
                (self.w2_weight.data.view(torch.int8).contiguous(), scales[1]),
                activation=self.activation))
        self.w13_weight = self.w13_weight_scale = None
        self.w2_weight = self.w2_weight_scale = None

    def get_symm_buffer(self):
        from vllm.utils.deep_gemm import _import_deep_gemm

        deep_gemm = _import_deep_gemm()
        group = get_ep_group().device_group
        key = (id(group), torch.accelerator.current_device_index(), self.num_experts,
               self.max_num_tokens, self.top_k, self.hidden_size, self.intermediate_size,
               self.activation)
        if key not in self._kimi_symm_buffer_cache:
            self._kimi_symm_buffer_cache[key] = deep_gemm.get_symm_buffer_for_mega_moe(
                group, self.num_experts, self.max_num_tokens, self.top_k, self.hidden_size,
                self.intermediate_size, activation=self.activation)
        return self._kimi_symm_buffer_cache[key]

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation_clamp: float | None,
                fast_math: bool = True) -> torch.Tensor:
        self.synchronize_first_launch()
        num_tokens = hidden_states.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError("Kimi K3 MegaMoE got more tokens than its buffer supports")
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        from vllm.utils.deep_gemm import _import_deep_gemm

        deep_gemm = _import_deep_gemm()
        buf = self.get_symm_buffer()
        is_padding = None
        if envs.VLLM_MOE_SKIP_PADDING and is_forward_context_available():
            is_padding = get_forward_context().is_padding
            if is_padding is not None:
                is_padding = is_padding[:num_tokens]
        prepare_megamoe_inputs(
            hidden_states, topk_weights, topk_ids, buf.x[:num_tokens], buf.x_sf[:num_tokens],
            buf.topk_idx[:num_tokens], buf.topk_weights[:num_tokens], is_padding=is_padding)
        self.finalize_weights()
        deep_gemm.fp8_fp4_mega_moe(
            y, self._transformed_l1_weights, self._transformed_l2_weights, buf,
            activation_clamp=activation_clamp, activation=self.activation,
            activation_beta=self.activation_beta,
            activation_linear_beta=self.activation_linear_beta, fast_math=fast_math)
        return y
