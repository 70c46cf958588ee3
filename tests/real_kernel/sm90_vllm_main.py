"""An experts module written to vLLM main's ``DeepseekV4MegaMoESM90Experts`` contract.

vLLM main's Hopper experts (``vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py``, stored
commit 6cd8b6b) need vLLM and a DeepGEMM fork, neither of which runs on a CPU or a Hopper
GPU (H100, H200).
This module (moewire's own code) keeps the parts of that contract moewire depends on:

- the buffer comes from ``deep_gemm.get_symm_buffer_for_sm90_mega_moe(group, E, T, k, H,
  I)``, cached per (group, shape) in a class dict; FP8 weights with 128x128 block scales
  go through ``transform_weights_for_mega_moe_sm90``; no fused shared expert;
- the forward reaches DeepGEMM through a call-time ``_import_deep_gemm()``; padding tokens
  (``forward_context.is_padding`` with ``skip_padding``, vLLM's ``VLLM_MOE_SKIP_PADDING``)
  get id -1 and weight 0; an EPLB state maps logical ids to physical replicas **before**
  staging; it stages inline (``deep_gemm.utils.per_token_cast_to_fp8(hidden_states,
  use_ue8m0=False, gran_k=128)``, then copies into ``x``/``x_sf``/``topk_idx``/
  ``topk_weights``) and calls ``deep_gemm.fp8_mega_moe_sm90(y, l1, l2, symm_buffer,
  cumulative_local_expert_recv_stats=..., activation_clamp=..., fast_math=...)``.

:func:`use_kernel` sets the DeepGEMM the forward gets: ``moewire.reference.sm90_fork`` on
CPU, ``moewire.integrations.deepgemm_sm90.fork_names()`` (PR #323 under the fork's names) on
the H200. :func:`register` registers the class through moewire's vLLM site entry for that
class (``moewire.integrations.vllm.sites``), with this module in the bridge's place.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import flavours
from moewire.megamoe.registry import register_experts_class

BLOCK = 128
#: What the forward's ``_import_deep_gemm()`` returns (moewire replaces it by its proxy).
deep_gemm: Any = None
#: vLLM's forward context, reduced to what the experts read.
forward_context = types.SimpleNamespace(is_padding=None)
#: vLLM's ``VLLM_MOE_SKIP_PADDING``.
skip_padding = True

SITE = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoESM90Experts")


#: Reach DeepGEMM as vLLM does, through ``vllm.utils.deep_gemm._import_deep_gemm()`` (the
#: ``vllm`` tests load this file under vLLM main's module name and set it).
VLLM_ACCESS = False


def _import_deep_gemm() -> Any:
    if VLLM_ACCESS:
        from vllm.utils.deep_gemm import _import_deep_gemm as vllm_access

        return vllm_access()
    return globals()["deep_gemm"]


def use_kernel(namespace: Any) -> None:
    """Make ``_import_deep_gemm()`` return ``namespace`` (and forget cached buffers)."""
    globals()["deep_gemm"] = namespace
    VllmMainSM90Experts._symm_buffer_cache.clear()


class VllmMainSM90Experts(nn.Module):
    """Routed experts shaped like vLLM main's ``DeepseekV4MegaMoESM90Experts``.

    Args:
        group: the EP process group (``None`` on CPU).
        num_experts: physical experts over the group; num_local_experts: this rank's.
        top_k, hidden_size, intermediate_size, max_num_tokens: the layer's shape.
        num_logical_experts: logical experts (fewer than physical with EPLB replicas).
    """

    _symm_buffer_cache: dict[tuple, Any] = {}

    def __init__(
        self, *, group: Any, num_experts: int, num_local_experts: int, top_k: int,
        hidden_size: int, intermediate_size: int, max_num_tokens: int,
        num_logical_experts: int | None = None, device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.group = group
        self.num_experts, self.num_local_experts = num_experts, num_local_experts
        self.num_logical_experts = num_logical_experts or num_experts
        self.top_k, self.hidden_size = top_k, hidden_size
        self.intermediate_size, self.max_num_tokens = intermediate_size, max_num_tokens
        e, h, i = num_local_experts, hidden_size, intermediate_size
        fp8 = dict(dtype=torch.float8_e4m3fn, device=device)
        self.w13_weight = nn.Parameter(torch.zeros(e, 2 * i, h, **fp8), requires_grad=False)
        self.w13_weight_scale_inv = nn.Parameter(
            torch.ones(e, 2 * i // BLOCK, h // BLOCK, device=device), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(e, h, i, **fp8), requires_grad=False)
        self.w2_weight_scale_inv = nn.Parameter(
            torch.ones(e, h // BLOCK, i // BLOCK, device=device), requires_grad=False)
        self._transformed: tuple | None = None
        self.logical_to_physical: torch.Tensor | None = None
        self.replica_count: torch.Tensor | None = None
        self.register_buffer(
            "cum_recv_stats", torch.zeros(e, dtype=torch.int32, device=device))

    def load_bf16(self, l1: torch.Tensor, l2: torch.Tensor) -> None:
        """Block-quantize BF16 ``[E, 2I, H]`` and ``[E, H, I]`` into the FP8 parameters
        (``sf = max(amax, 1e-4) / 448`` per 128x128 block, as the checkpoint's)."""
        (w13, s13), (w2, s2) = self._fp8(l1), self._fp8(l2)
        self.w13_weight.data.copy_(w13)
        self.w13_weight_scale_inv.data.copy_(s13)
        self.w2_weight.data.copy_(w2)
        self.w2_weight_scale_inv.data.copy_(s2)
        self._transformed = None

    @staticmethod
    def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e, n, k = w.shape
        blocks = w.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        sf = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
        q = (blocks / sf[:, :, None, :, None]).to(torch.float8_e4m3fn)
        return q.view(e, n, k), sf

    def finalize_weights(self) -> None:
        if self._transformed is None:
            self._transformed = _import_deep_gemm().transform_weights_for_mega_moe_sm90(
                (self.w13_weight.data, self.w13_weight_scale_inv.data),
                (self.w2_weight.data, self.w2_weight_scale_inv.data),
            )

    @property
    def has_fused_shared_experts(self) -> bool:
        return False

    def get_symm_buffer(self) -> Any:
        key = (self.group, self.num_experts, self.max_num_tokens, self.top_k,
               self.hidden_size, self.intermediate_size)
        buffer = self._symm_buffer_cache.get(key)
        if buffer is None:
            buffer = _import_deep_gemm().get_symm_buffer_for_sm90_mega_moe(
                self.group, self.num_experts, self.max_num_tokens, self.top_k,
                self.hidden_size, self.intermediate_size)
            self._symm_buffer_cache[key] = buffer
        return buffer

    def set_eplb_state(self, logical_to_physical: torch.Tensor, replica_count: torch.Tensor
                       ) -> None:
        """``logical_to_physical``: int ``[L, R]`` (replica j of logical expert l), the
        first ``replica_count[l]`` valid; token ``t`` uses replica ``t % count``."""
        self.logical_to_physical, self.replica_count = logical_to_physical, replica_count

    def _map_to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        valid = topk_ids >= 0
        logical = topk_ids.clamp(min=0).long()
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        replica = token % self.replica_count[logical]
        physical = self.logical_to_physical[logical, replica]
        return torch.where(valid, physical, topk_ids)

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        *, activation_clamp: float | None, fast_math: bool = True,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens exceed the buffer's {self.max_num_tokens}")
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        dg = _import_deep_gemm()
        symm_buffer = self.get_symm_buffer()
        is_padding = forward_context.is_padding if skip_padding else None
        if is_padding is not None:
            pad = is_padding[:num_tokens].unsqueeze(1)
            topk_ids = torch.where(pad, -1, topk_ids)
            topk_weights = torch.where(pad, 0.0, topk_weights)
        if self.logical_to_physical is not None:
            topk_ids = self._map_to_physical(topk_ids)
        x_fp8, x_sf = dg.utils.per_token_cast_to_fp8(hidden_states, use_ue8m0=False, gran_k=128)
        symm_buffer.x[:num_tokens].copy_(x_fp8)
        symm_buffer.x_sf[:num_tokens].copy_(x_sf)
        symm_buffer.topk_idx[:num_tokens].copy_(topk_ids.to(torch.int64))
        symm_buffer.topk_weights[:num_tokens].copy_(topk_weights.to(torch.float32))
        self.finalize_weights()
        l1, l2 = self._transformed
        dg.fp8_mega_moe_sm90(
            y, l1, l2, symm_buffer,
            cumulative_local_expert_recv_stats=self.cum_recv_stats,
            activation_clamp=activation_clamp, fast_math=fast_math,
        )
        return y


def _flavour(module: nn.Module) -> str:
    return flavours.detect(_import_deep_gemm(), type(module).__name__).name


def register(cls: type = VllmMainSM90Experts, get_symm_buffer: Any = None) -> None:
    """Register ``cls`` through moewire's vLLM site entry for the SM90 experts, with this
    module where the bridge sits under vLLM (its ``deep_gemm`` global, inline staging)."""
    register_experts_class(cls, vllm_sites.site_adapter(
        SITE, cls, forward_module=__name__, stage_globals=(), flavour=_flavour,
        ep_group=lambda m: None, runtime=lambda: "vLLM main's SM90 contract (moewire's module)",
        get_symm_buffer=get_symm_buffer,
    ))


register()
