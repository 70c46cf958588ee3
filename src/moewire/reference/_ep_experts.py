"""What the stand-in experts modules share: the EP partition of the experts, the default
device, the buffer cache, the routed weights under vLLM's parameter names, the checks of the
weights' experts and of the token count, and the fused shared expert's kernel arguments.

vLLM caches one symmetric buffer per (EP group, device, shapes, shared count, ...), and
layers of the same shapes share it; so does the stand-in, in one cache that holds
buffers weakly and keys them by the group object itself (never its ``id()``: a freed
group's id could come back for a new one).

May import: torch and ``moewire.reference._alloc``. The real SM90 kernel's experts module
(``moewire.integrations.deepgemm_sm90``) runs :class:`MegaMoEForward` too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moewire.reference._alloc import default_device

__all__ = ["EPExperts", "MegaMoEForward", "kernel_weights"]

_SYMM_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class MegaMoEForward(nn.Module):
    """vLLM's Mega-MoE experts forward, written once for every experts module (the stand-in's
    three and the real SM90 kernel's): check the call, run the routed experts (a subclass's
    :meth:`_routed`: stage the tokens through its module's staging global and call the kernel
    through its module's ``deep_gemm`` global, where moewire interposes), then add an
    unfused shared expert (it sees the unquantized tokens, as vLLM's)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: nn.Module | None = None,
    ) -> torch.Tensor:
        """Routed experts (plus a fused shared expert), then an unfused one if given.

        Args:
            hidden_states: BF16 (or the layer's ``dtype``) ``[T, H]``,
                ``T <= max_num_tokens``.
            topk_weights: FP32 ``[T, k]`` router weights.
            topk_ids: integer ``[T, k]`` global expert ids (-1 masks a slot).
            shared_experts: an unfused shared expert, added after the kernel.

        Returns:
            BF16 ``[T, H]``.
        """
        num_tokens = self._check_inputs(hidden_states, shared_experts)
        y = self._routed(hidden_states, topk_weights, topk_ids, num_tokens)
        if shared_experts is not None:
            y += shared_experts(hidden_states)
        return y

    def _check_inputs(self, hidden_states: torch.Tensor,
                      shared_experts: nn.Module | None) -> int:
        """Refuse a call the module cannot serve; returns its token count ``T``."""
        raise NotImplementedError

    def _routed(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Stage the call's tokens and run the kernel: BF16 ``y [T, H]``."""
        raise NotImplementedError


class EPExperts(MegaMoEForward):
    """Base of the stand-in experts modules: the routed experts of one EP rank.

    Attributes set by ``__init__``: ``num_experts``, ``top_k``, ``hidden``,
    ``intermediate``, ``max_num_tokens``, ``ep_group``, ``ep_size``, ``ep_rank``,
    ``num_local_experts``, ``local_experts`` (this rank's global expert ids),
    ``num_fused_shared_experts``, ``fused_shared``; :meth:`get_symm_buffer` returns
    ``symm_buffer``, which the subclass sets from :meth:`_cached_buffer`. With a fused shared
    expert the subclass holds its kernel weights in ``shared_l1_weights`` and
    ``shared_l2_weights`` (read by :meth:`_fused_shared_kwargs`).
    """

    symm_buffer: Any

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_num_tokens: int, group: dist.ProcessGroup | None,
                 num_fused_shared_experts: int) -> None:
        """Split ``num_experts`` evenly over the EP group; this rank keeps its slice.

        Raises:
            ValueError: ``num_experts`` is not divisible by the group's size.
        """
        super().__init__()
        ep_size, ep_rank = (1, 0) if group is None else (group.size(), group.rank())
        if num_experts % ep_size:
            raise ValueError(
                f"{type(self).__name__}: num_experts={num_experts} is not divisible by the EP "
                f"size {ep_size}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.max_num_tokens = max_num_tokens
        self.ep_group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        self.num_local_experts = num_experts // ep_size
        self.local_experts = tuple(
            range(ep_rank * self.num_local_experts, (ep_rank + 1) * self.num_local_experts)
        )
        self.num_fused_shared_experts = num_fused_shared_experts
        self.fused_shared = num_fused_shared_experts > 0

    def _device(self, device: torch.device | str | None) -> torch.device:
        """``device``, by default CUDA when available and the EP group is NCCL or None, else
        the CPU."""
        if device is None:
            device = default_device(self.ep_group)
        return torch.device(device)

    def _check_experts(self, experts: Any, maker: str) -> None:
        """The weights hold this rank's experts; ``maker`` names the builder in the fix.

        Raises:
            ValueError: they hold other experts.
        """
        if tuple(experts) != self.local_experts:
            raise ValueError(
                f"{type(self).__name__}: weights hold experts {experts[:4]}... but EP rank "
                f"{self.ep_rank} owns {self.local_experts[:4]}...; build them with "
                f"{maker}(experts=range({self.local_experts[0]}, "
                f"{self.local_experts[-1] + 1}))"
            )

    def _cached_buffer(self, key: tuple[Hashable, ...], build: Callable[[], Any]) -> Any:
        """The buffer of this group and these shapes (plus ``key``), built once while any
        layer holds it."""
        key = (
            self.ep_group, self.num_experts, self.max_num_tokens, self.top_k, self.hidden,
            self.intermediate, self.num_fused_shared_experts, *key,
        )
        buffer = _SYMM_BUFFERS.get(key)
        if buffer is None:
            buffer = build()
            _SYMM_BUFFERS[key] = buffer
        return buffer

    def _register_routed_weights(self, l1: Any, l2: Any, *, scaled: bool = True) -> None:
        """The routed experts' weights under vLLM's parameter names: ``w13_weight`` and
        ``w13_weight_scale`` (L1), ``w2_weight`` and ``w2_weight_scale`` (L2).

        Args:
            l1, l2: ``(weight, scale)`` pairs, or with ``scaled=False`` the BF16 weights
                alone (their ``*_weight_scale`` is then None).
        """
        for name, weights in (("w13", l1), ("w2", l2)):
            weight, scale = weights if scaled else (weights, None)
            self.register_buffer(f"{name}_weight", weight)
            self.register_buffer(f"{name}_weight_scale", scale)

    def _kernel_weights(self, name: str) -> Any:
        """The kernel's argument of the weights registered as ``{name}_weight`` (and
        ``{name}_weight_scale``): :func:`kernel_weights`."""
        return kernel_weights(getattr(self, f"{name}_weight"),
                              getattr(self, f"{name}_weight_scale"))

    @property
    def l1_weights(self) -> Any:
        """The kernel's L1 argument: ``(w13_weight, w13_weight_scale)``, or the BF16 weight."""
        return self._kernel_weights("w13")

    @property
    def l2_weights(self) -> Any:
        """The kernel's L2 argument: ``(w2_weight, w2_weight_scale)``, or the BF16 weight."""
        return self._kernel_weights("w2")

    def get_symm_buffer(self) -> Any:
        """The layer's symmetric buffer (shared by layers of the same shapes and group)."""
        return self.symm_buffer

    def _fused_shared_kwargs(self) -> dict[str, Any]:
        """The kernel's ``shared_l1_weights`` and ``shared_l2_weights`` keywords with a fused
        shared expert, else none."""
        if not self.fused_shared:
            return {}
        return {
            "shared_l1_weights": self.shared_l1_weights,
            "shared_l2_weights": self.shared_l2_weights,
        }

    def _check_inputs(self, hidden_states: torch.Tensor,
                      shared_experts: nn.Module | None) -> int:
        """The checks vLLM's NVFP4 forwards make before staging: an unfused shared expert
        only without a fused one, and no more tokens than the buffer holds.

        Returns:
            the call's token count ``T``.
        """
        if shared_experts is not None and self.fused_shared:
            raise ValueError(f"{type(self).__name__} fuses the shared expert; pass "
                             "shared_experts=None")
        num_tokens = hidden_states.shape[0]
        self._check_num_tokens(num_tokens)
        return num_tokens

    def _check_num_tokens(self, num_tokens: int) -> None:
        """Raises ``ValueError`` for more tokens than the buffer holds (vLLM's check)."""
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"{type(self).__name__}: got {num_tokens} tokens but max_num_tokens="
                f"{self.max_num_tokens}; split the batch or build the layer with a larger "
                "max_num_tokens"
            )


def kernel_weights(weight: torch.Tensor | None, scale: torch.Tensor | None) -> Any:
    """The kernel's weights argument: ``(weight, scale)`` for scaled (FP8 or FP4) weights,
    the BF16 weight alone (no scale), ``None`` for an absent shared expert."""
    return weight if scale is None else (weight, scale)
