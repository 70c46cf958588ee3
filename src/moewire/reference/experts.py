"""A vLLM-like Mega-MoE experts module on top of the stand-in kernel.

:class:`MegaMoEExperts` follows vLLM's ``DeepGemmMegaMoEExperts.forward`` step by step:
check ``T <= max_num_tokens``, read ``is_padding`` from the forward context, stage the
inputs into the symmetric buffer, allocate ``y``, call the kernel through the ``deep_gemm``
namespace, then add an unfused shared expert. The staging function and the kernel
namespace are module globals looked up at call time (``stage_mega_moe_inputs`` and
``deep_gemm``), which is where a quantization wrapper interposes.

May import: torch, ``moewire.reference.deep_gemm`` (the API, as vLLM calls it),
``_ep_experts`` and ``weights``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moewire.reference import deep_gemm
from moewire.reference._ep_experts import EPExperts
from moewire.reference.deep_gemm import per_token_cast_to_fp8
from moewire.reference.weights import MegaMoEWeights, make_weights

__all__ = [
    "ForwardContext",
    "MegaMoEExperts",
    "forward_context",
    "get_forward_context",
    "stage_mega_moe_inputs",
]


@dataclass
class ForwardContext:
    """vLLM's forward context, reduced to what the experts read.

    Attributes:
        is_padding: bool ``[>= T]`` (True for padding tokens), or None.
    """

    is_padding: torch.Tensor | None = None


_CONTEXTS: list[ForwardContext] = []


@contextlib.contextmanager
def forward_context(is_padding: torch.Tensor | None = None) -> Iterator[ForwardContext]:
    """Set the forward context for the block (vLLM's ``set_forward_context`` stand-in)."""
    context = ForwardContext(is_padding=is_padding)
    _CONTEXTS.append(context)
    try:
        yield context
    finally:
        _CONTEXTS.pop()


def get_forward_context() -> ForwardContext:
    """The innermost :func:`forward_context`, or an empty one outside any."""
    return _CONTEXTS[-1] if _CONTEXTS else ForwardContext()


def stage_mega_moe_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    symm_buffer: deep_gemm.SymmBuffer,
    is_padding: torch.Tensor | None = None,
) -> None:
    """Stage ``T`` tokens into the buffer (vLLM's ``prepare_megamoe_inputs``).

    ``fp8xfp4``: ``x[:T], x_sf[:T] = per_token_cast_to_fp8(hidden_states, use_ue8m0=True,
    gran_k=32, use_packed_ue8m0=True)`` (MXFP8-like, UE8M0 per 32, amax floor 1e-4);
    ``bf16xbf16``: ``x[:T] = bf16(hidden_states)``. ``topk_idx[:T] = topk_ids`` (int64),
    ``topk_weights[:T] = topk_weights`` (FP32); padding tokens get id -1 and weight 0 in
    every slot.

    Args:
        hidden_states: ``[T, H]`` floating.
        topk_ids: integer ``[T, k]``, -1 for a masked slot.
        topk_weights: floating ``[T, k]``.
        symm_buffer: the layer's buffer.
        is_padding: bool ``[>= T]`` or None.
    """
    where = "stage_mega_moe_inputs"
    buf = symm_buffer
    if hidden_states.dim() != 2 or hidden_states.shape[1] != buf.hidden:
        raise ValueError(
            f"{where}: hidden_states must be [T, {buf.hidden}], got {tuple(hidden_states.shape)}"
        )
    if not hidden_states.is_floating_point():
        raise TypeError(f"{where}: hidden_states must be floating, got {hidden_states.dtype}")
    t = hidden_states.shape[0]
    if t > buf.num_max_tokens_per_rank:
        raise ValueError(
            f"{where}: T={t} tokens exceed the buffer's num_max_tokens_per_rank="
            f"{buf.num_max_tokens_per_rank}"
        )
    for name, value in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tuple(value.shape) != (t, buf.num_topk):
            raise ValueError(
                f"{where}: {name} must be [T, k] = [{t}, {buf.num_topk}], got "
                f"{tuple(value.shape)}"
            )
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise TypeError(f"{where}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"{where}: topk_weights must be floating, got {topk_weights.dtype}")
    device = buf.buffer.device
    for name, value in (("hidden_states", hidden_states), ("topk_ids", topk_ids),
                        ("topk_weights", topk_weights)):
        if value.device != device:
            raise ValueError(
                f"{where}: {name} is on {value.device} but the symm buffer is on {device}"
            )
    ids, weights = topk_ids.long(), topk_weights.float()
    if is_padding is not None:
        if is_padding.dim() != 1 or is_padding.shape[0] < t:
            raise ValueError(
                f"{where}: is_padding must be 1-D with at least T={t} entries, got "
                f"{tuple(is_padding.shape)}"
            )
        pad = is_padding[:t].to(device=device, dtype=torch.bool).unsqueeze(1)
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
        weights = torch.where(pad, torch.zeros_like(weights), weights)
    if buf.mma_type == "fp8xfp4":
        q, sf = per_token_cast_to_fp8(
            hidden_states, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True
        )
        buf.x[:t].copy_(q)
        buf.x_sf[:t].copy_(sf)
    else:
        buf.x[:t].copy_(hidden_states)
    buf.topk_idx[:t].copy_(ids)
    buf.topk_weights[:t].copy_(weights)



def padding_rows(num_tokens: int) -> torch.Tensor | None:
    """The forward context's padding flags of the call's ``num_tokens`` tokens, or ``None``
    when the context has none."""
    is_padding = get_forward_context().is_padding
    return None if is_padding is None else is_padding[:num_tokens]


class MegaMoEExperts(EPExperts):
    """Mega-MoE routed experts of one EP rank, with vLLM's forward contract.

    Args:
        num_experts: routed experts over the EP group (split evenly over its ranks).
        top_k: routed slots per token.
        hidden: H; intermediate: I per expert.
        max_num_tokens: tokens per rank per call (the buffer rounds its capacity up to 384).
        group: EP process group or None (one rank).
        num_fused_shared_experts: > 0 fuses a shared expert of ``n * I`` into the kernel.
        mma_type: ``"fp8xfp4"`` or ``"bf16xbf16"``.
        activation_clamp: SwiGLU clamp, or None.
        weights: this rank's :class:`MegaMoEWeights`; default ``make_weights(seed=seed)``
            for the local experts.
        seed: seed of the default weights.
        device: default CUDA when available and the group is NCCL or None, else CPU.
        dtype: the dtype of ``hidden_states`` (the output ``y`` is BF16, as the kernel's).
    """

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, max_num_tokens: int,
        *, group: dist.ProcessGroup | None = None, num_fused_shared_experts: int = 0,
        mma_type: str = "fp8xfp4",
        activation_clamp: float | None = None,
        weights: MegaMoEWeights | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(num_experts, top_k, hidden, intermediate, max_num_tokens, group,
                         num_fused_shared_experts)
        where = type(self).__name__
        self.mma_type = mma_type
        self.activation_clamp = activation_clamp
        self.dtype = dtype
        self.kernel_name = "fp8_fp4_mega_moe" if mma_type == "fp8xfp4" else "bf16_mega_moe"
        device = self._device(device)
        self.symm_buffer = self._build_symm_buffer(device)
        if weights is None:
            weights = make_weights(
                num_experts, hidden, intermediate, experts=self.local_experts,
                mma_type=mma_type, num_shared_experts=num_fused_shared_experts, seed=seed,
                device=device,
            )
        self._check_weights(weights, where)
        fp8 = mma_type == "fp8xfp4"
        self._register_routed_weights(weights.l1, weights.l2, scaled=fp8)
        shared = weights.shared_l1 is not None
        self.register_buffer("shared_w13_weight", _part(weights.shared_l1, 0, fp8, shared))
        self.register_buffer("shared_w13_weight_scale", _part(weights.shared_l1, 1, fp8, shared))
        self.register_buffer("shared_w2_weight", _part(weights.shared_l2, 0, fp8, shared))
        self.register_buffer("shared_w2_weight_scale", _part(weights.shared_l2, 1, fp8, shared))

    def _check_weights(self, weights: MegaMoEWeights, where: str) -> None:
        if weights.mma_type != self.mma_type:
            raise ValueError(
                f"{where}: weights are {weights.mma_type!r} but mma_type={self.mma_type!r}"
            )
        self._check_experts(weights.experts, "make_weights")
        if self.fused_shared != (weights.shared_l1 is not None):
            raise ValueError(
                f"{where}: num_fused_shared_experts={self.num_fused_shared_experts} but the "
                f"weights {'lack' if self.fused_shared else 'hold'} a fused shared expert"
            )

    def _build_symm_buffer(self, device: torch.device) -> deep_gemm.SymmBuffer:
        # Keyed like vLLM's cache: EP group and shapes (plus the flavour, the device and
        # the FP8-combine switch, which a real build fixes once).
        fp8_combine = os.environ.get(deep_gemm.ENV_FP8_COMBINE, "0").strip() == "1"
        return self._cached_buffer(
            (self.mma_type, deep_gemm.current_flavour(), device, fp8_combine),
            lambda: deep_gemm.get_symm_buffer_for_mega_moe(
                self.ep_group, self.num_experts, self.max_num_tokens, self.top_k,
                self.hidden, self.intermediate,
                num_shared_experts=self.num_fused_shared_experts, mma_type=self.mma_type,
                device=device,
            ),
        )

    @property
    def shared_l1_weights(self) -> Any:
        return self._kernel_weights("shared_w13")

    @property
    def shared_l2_weights(self) -> Any:
        return self._kernel_weights("shared_w2")

    def _check_inputs(self, hidden_states: torch.Tensor,
                      shared_experts: nn.Module | None) -> int:
        """No more tokens than the buffer holds, in the layer's ``dtype`` (an unfused shared
        expert is added even beside a fused one)."""
        num_tokens = hidden_states.shape[0]
        self._check_num_tokens(num_tokens)
        if hidden_states.dtype != self.dtype:
            raise TypeError(
                f"{type(self).__name__}: hidden_states is {hidden_states.dtype} but the "
                f"layer was built for dtype={self.dtype}"
            )
        return num_tokens

    def _routed(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        is_padding = get_forward_context().is_padding
        symm_buffer = self.get_symm_buffer()
        stage_mega_moe_inputs(hidden_states, topk_ids, topk_weights, symm_buffer, is_padding)
        y = torch.empty(
            (num_tokens, self.hidden), dtype=torch.bfloat16, device=hidden_states.device
        )
        kwargs: dict[str, Any] = {
            "activation_clamp": self.activation_clamp, **self._fused_shared_kwargs()
        }
        getattr(deep_gemm, self.kernel_name)(
            y, self.l1_weights, self.l2_weights, symm_buffer, **kwargs
        )
        return y


def _part(weights: Any, index: int, fp8: bool, present: bool) -> torch.Tensor | None:
    if not present:
        return None
    if fp8:
        return weights[index]
    return weights if index == 0 else None
