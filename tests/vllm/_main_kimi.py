"""A stand-in written to vLLM main's Kimi-K3 latent Mega-MoE contract.

Contract (read, not copied): ``vllm/models/kimi_k3/nvidia/model.py`` at ed51064 (006193b's
experts class is the same). ``KimiK3MegaMoEExperts`` takes ``activation``,
``activation_beta``, ``activation_linear_beta``; keeps its own buffer cache
(``_kimi_symm_buffer_cache``, keyed by group, device, shapes and activation); synchronises
the EP group once before its first launch (``synchronize_first_launch``: accelerator sync,
then a barrier on the EP CPU group, remembered per group and device); packs its weights with
``transform_weights_for_mega_moe(..., activation=self.activation)``; and its forward stages
with the global ``prepare_megamoe_inputs`` (``is_padding`` from the forward context) and
calls ``deep_gemm.fp8_fp4_mega_moe(y, l1, l2, buf, activation_clamp=, activation=,
activation_beta=, activation_linear_beta=, fast_math=)`` on ``_import_deep_gemm()`` itself
(no backend). ``KimiMoE`` runs the experts on the latent width: the router and a replicated
down-projection read the model's hidden states, the experts the projected (latent) tokens,
and ``KimiRoutedOutputTransform`` (optional RMSNorm, then the up-projection) adds the shared
experts' output (computed on the original hidden states) in its GEMM's epilogue
(``residual.addmm_``).

This module is both the experts' module and, for the tests, the bridge: ``deep_gemm`` is
what ``_import_deep_gemm()`` returns (the stand-in kernel; its build ``deepgemm-vllm-situ``
spells SiTU's scales as this call does).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from _standin import prepare_megamoe_inputs_reference
from torch import nn

from moewire.reference import deep_gemm as reference
from moewire.reference import get_forward_context, make_weights

deep_gemm: Any = reference
prepare_megamoe_inputs = prepare_megamoe_inputs_reference
#: The EP group of this one-rank stand-in (vLLM's ``get_ep_group()``), and the barriers
#: ``synchronize_first_launch`` made on its CPU group.
EP_GROUP = SimpleNamespace(cpu_group=object(), device_group=None, world_size=1, rank_in_group=0)
BARRIERS: list[object] = []


def _import_deep_gemm() -> Any:
    return globals()["deep_gemm"]


def get_ep_group() -> Any:
    return EP_GROUP


class KimiK3MegaMoEExperts(nn.Module):
    """Kimi-K3's routed experts on the latent width (one rank, stand-in kernel).

    Args:
        num_experts, top_k, hidden_size, intermediate_size, max_num_tokens: the layer's
            shape (``hidden_size`` is the latent width).
        activation, activation_beta, activation_linear_beta: SiTU and its gate and up tanh
            scales (``activation_situ_beta``, ``activation_situ_linear_beta``).
        seed: of the weights.
    """

    _kimi_symm_buffer_cache: dict[tuple[object, ...], object] = {}
    _synchronized_ep_groups: set[tuple[int, int]] = set()

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 max_num_tokens: int, *, activation: str, activation_beta: float | None,
                 activation_linear_beta: float | None, seed: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.max_num_tokens = max_num_tokens
        self.activation = activation
        self.activation_beta = activation_beta
        self.activation_linear_beta = activation_linear_beta
        raw = make_weights(num_experts, hidden_size, intermediate_size, seed=seed)
        self._raw = (raw.l1_raw, raw.l2_raw)
        self._transformed_l1_weights: Any = None
        self._transformed_l2_weights: Any = None
        self.register_buffer("anchor", torch.zeros(()))

    @property
    def has_fused_shared_experts(self) -> bool:
        return False

    def synchronize_first_launch(self) -> None:
        ep_group = get_ep_group()
        key = (id(ep_group.cpu_group), 0)
        if key in self._synchronized_ep_groups:
            return
        BARRIERS.append(ep_group.cpu_group)
        self._synchronized_ep_groups.add(key)

    def finalize_weights(self) -> None:
        if self._transformed_l1_weights is not None:
            return
        deep_gemm = _import_deep_gemm()
        self._transformed_l1_weights, self._transformed_l2_weights = (
            deep_gemm.transform_weights_for_mega_moe(*self._raw, activation=self.activation)
        )

    def get_symm_buffer(self) -> Any:
        deep_gemm = _import_deep_gemm()
        key = (id(get_ep_group().device_group), 0, self.num_experts, self.max_num_tokens,
               self.top_k, self.hidden_size, self.intermediate_size, self.activation)
        symm_buffer = self._kimi_symm_buffer_cache.get(key)
        if symm_buffer is None:
            symm_buffer = deep_gemm.get_symm_buffer_for_mega_moe(
                None, self.num_experts, self.max_num_tokens, self.top_k, self.hidden_size,
                self.intermediate_size, activation=self.activation, device="cpu")
            self._kimi_symm_buffer_cache[key] = symm_buffer
        return symm_buffer

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation_clamp: float | None,
                fast_math: bool = True) -> torch.Tensor:
        self.synchronize_first_launch()
        if hidden_states.shape[0] > self.max_num_tokens:
            raise ValueError("Kimi K3 MegaMoE got more tokens than its buffer supports")
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        deep_gemm = _import_deep_gemm()
        symm_buffer = self.get_symm_buffer()
        num_tokens = hidden_states.shape[0]
        is_padding = get_forward_context().is_padding
        prepare_megamoe_inputs(
            hidden_states, topk_weights, topk_ids, symm_buffer.x[:num_tokens],
            symm_buffer.x_sf[:num_tokens], symm_buffer.topk_idx[:num_tokens],
            symm_buffer.topk_weights[:num_tokens], is_padding=is_padding)
        self.finalize_weights()
        deep_gemm.fp8_fp4_mega_moe(
            y, self._transformed_l1_weights, self._transformed_l2_weights, symm_buffer,
            activation_clamp=activation_clamp, activation=self.activation,
            activation_beta=self.activation_beta,
            activation_linear_beta=self.activation_linear_beta, fast_math=fast_math)
        return y


def situ(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """vLLM's ``SituAndMul`` on FP32: ``beta tanh(g/beta) sigmoid(g) * (linear_beta
    tanh(u/linear_beta) if linear_beta else u)``."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta:
        up = linear_beta * torch.tanh(up / linear_beta)
    return gated * up


class KimiMLP(nn.Module):
    """The shared experts' MLP (replicated, BF16), SiTU on the model's hidden states."""

    def __init__(self, hidden: int, intermediate: int, beta: float, linear_beta: float,
                 seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter(
            (torch.randn(2 * intermediate, hidden, generator=g) * hidden**-0.5).bfloat16(),
            requires_grad=False)
        self.down_proj = nn.Parameter(
            (torch.randn(hidden, intermediate, generator=g) * intermediate**-0.5).bfloat16(),
            requires_grad=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ(x @ self.gate_up_proj.t(), self.beta, self.linear_beta).bfloat16()
        return h @ self.down_proj.t()


class KimiRoutedOutputTransform(nn.Module):
    """Optional RMSNorm of the routed latent, then the up-projection to the model's
    hidden size, the shared output added in that GEMM's epilogue (``residual.addmm_``)."""

    def __init__(self, latent: int, hidden: int, seed: int, eps: float = 1e-6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm_weight = nn.Parameter((1 + 0.1 * torch.randn(latent, generator=g)).bfloat16(),
                                        requires_grad=False)
        self.up_proj = nn.Parameter(
            (torch.randn(hidden, latent, generator=g) * latent**-0.5).bfloat16(),
            requires_grad=False)
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden_states.float()
        x = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)).bfloat16()
        x = x * self.norm_weight
        if residual is not None:
            return residual.addmm_(x, self.up_proj.t())
        return x @ self.up_proj.t()


class KimiMoE(nn.Module):
    """One Kimi-K3 MoE block on Mega-MoE: router and down-projection on the model's hidden
    states, the experts on the latent tokens, the transform with the shared output."""

    def __init__(self, hidden: int, latent: int, num_experts: int, top_k: int,
                 intermediate: int, max_num_tokens: int, *, num_shared: int = 2,
                 beta: float = 4.0, linear_beta: float = 25.0, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 7)
        self.gate = nn.Parameter(torch.randn(num_experts, hidden, generator=g) * hidden**-0.5,
                                 requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            0.01 * torch.randn(num_experts, generator=g), requires_grad=False)
        self.routed_expert_down_proj = nn.Parameter(
            (torch.randn(latent, hidden, generator=g) * hidden**-0.5).bfloat16(),
            requires_grad=False)
        self.top_k = top_k
        self.experts = KimiK3MegaMoEExperts(
            num_experts, top_k, latent, intermediate, max_num_tokens, activation="situ",
            activation_beta=beta, activation_linear_beta=linear_beta, seed=seed)
        self.shared_experts = KimiMLP(hidden, num_shared * intermediate, beta, linear_beta,
                                      seed + 11)
        self.routed_output_transform = KimiRoutedOutputTransform(latent, hidden, seed + 13)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores, top-k by score + correction bias, weights renormalised (one
        expert group)."""
        scores = torch.sigmoid(hidden_states.float() @ self.gate.t())
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / weights.sum(-1, keepdim=True), ids

    def down_project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.routed_expert_down_proj.t()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = self.down_project(hidden_states)
        weights, ids = self.route(hidden_states)
        final = self.experts(routed, weights, ids, activation_clamp=None)
        shared = self.shared_experts(hidden_states)
        return self.routed_output_transform(final, residual=shared)
