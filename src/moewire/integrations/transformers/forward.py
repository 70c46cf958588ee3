"""The ``"moewire"`` experts forward: the experts of one transformers module through the
Mega-MoE contract of the kernel its state holds, the way vLLM's ``DeepGemmMegaMoEExperts``
does:

1. stage the tokens, ids and router weights into the layer's symmetric buffer
   (``stage_mega_moe_inputs``: BF16 tokens for ``bf16xbf16``, UE8M0-per-32 FP8 for
   ``fp8xfp4``; :func:`stage_fp4_fp4_inputs` for ``fp4xfp4``; ``stage_sm90_inputs`` for the
   real SM90 kernel), in chunks of at most the buffer's capacity;
2. call the kernel through the ``deep_gemm`` namespace (``bf16_mega_moe``,
   ``fp8_fp4_mega_moe``, ...): ``y = sum_k w_k * L2(act(L1(x)))`` with the router weight
   applied to L1's activation, BF16 rows summed in FP32 (``moewire.reference.deep_gemm``);
3. return ``y`` in ``hidden_states``' dtype.

The staging functions and ``deep_gemm`` are this module's globals, read at call time, so
:func:`moewire.quantize` interposes on them as on vLLM's forward (the experts adapter names
this module).

May import: the standard library, torch, ``moewire.reference``,
``moewire.integrations.deepgemm_sm90`` and this package's ``ep``, ``megamoe``, ``state`` and
``architectures``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moewire.integrations import deepgemm_sm90 as sm90
from moewire.integrations.deepgemm_sm90 import stage_sm90_inputs
from moewire.integrations.transformers import ep, megamoe
from moewire.integrations.transformers.architectures import _where
from moewire.integrations.transformers.state import _MegaState, _state
from moewire.reference import deep_gemm as stand_in
from moewire.reference.experts import stage_mega_moe_inputs
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

__all__ = ["deep_gemm", "moewire_experts_forward", "stage_fp4_fp4_inputs"]


class _Kernels:
    """The kernel namespace the experts forward reads at call time (the adapter's
    ``kernel_ns``, which :func:`moewire.quantize` replaces by its proxy): each kernel
    function from the package that has it, the stand-in's ``bf16_mega_moe`` and
    ``fp8_fp4_mega_moe``, DeepGEMM's SM90 ``fp8_mega_moe`` (imported at first use)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(sm90.deep_gemm if name == "fp8_mega_moe" else stand_in, name)

    def __repr__(self) -> str:
        return "<moewire.integrations.transformers kernels>"


deep_gemm = _Kernels()


def stage_fp4_fp4_inputs(hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, buffer: Any) -> None:
    """Stage ``T`` tokens into an ``fp4xfp4`` buffer as vLLM main's
    ``DeepseekV32MegaMoEExperts`` does (``prepare_megamoe_nvfp4_inputs``, NVFP4 per 16);
    the arguments of :func:`~moewire.reference.experts.stage_mega_moe_inputs`."""
    t = hidden_states.shape[0]
    prepare_megamoe_nvfp4_inputs(
        hidden_states, topk_weights, topk_ids, buffer.x[:t], buffer.x_sf[:t],
        buffer.topk_idx[:t], buffer.topk_weights[:t],
    )
def _group_name(group: Any) -> str | None:
    return None if group is None else group.group_name


def _check_call(module: nn.Module, state: _MegaState, hidden: torch.Tensor,
                process_group: Any) -> None:
    """Refuse a call the kernel cannot serve under expert parallelism: with gradients
    (``MegaMoeEP`` runs at inference only: the kernel has no backward and the all-gather is
    not differentiated), without the group its buffer spans, or with another group."""
    where = _where(module)
    if process_group is not None and torch.is_grad_enabled() and hidden.requires_grad:
        raise RuntimeError(
            f"{where}: under expert parallelism the Mega-MoE experts run at inference only "
            "(the kernel has no backward and MegaMoeEP's all-gather is not differentiated), "
            "but gradients are enabled; run the model under torch.no_grad() or "
            "torch.inference_mode()"
        )
    ranks = 1 if state.group is None else state.group.size()
    if process_group is None and ranks > 1:
        raise RuntimeError(
            f"{where}: the buffer spans an expert-parallel group of {ranks} ranks, but the "
            "experts were called without process_group: an EP implementation other than "
            f"{ep.IMPLEMENTATION!r} called them, with local expert ids the Mega-MoE buffer does "
            f"not dispatch; load with DistributedConfig(..., ep_implementation="
            f"{ep.IMPLEMENTATION!r})"
        )
    if process_group is None:
        return
    if process_group.size() > 1 and _group_name(process_group) != _group_name(state.group):
        raise RuntimeError(
            f"{where}: called with the expert-parallel group {process_group.group_name!r} "
            f"({process_group.size()} ranks), but its buffer was built on "
            f"{_group_name(state.group)!r}; call prepare(model) after from_pretrained, under "
            "the same DistributedConfig"
        )


def moewire_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    process_group: Any = None,
) -> torch.Tensor:
    """The ``"moewire"`` experts implementation (the module docstring says the steps).

    Under transformers' EP, ``MegaMoeEP`` calls it with this rank's slice of the batch,
    global expert ids (``-1`` on padding rows) and the EP group (:mod:`.ep`); inside a
    module moewire converted it runs within the quantized forward
    (:func:`.megamoe.run_quantized`), which EP bypasses otherwise.

    Args:
        self: the transformers experts module.
        hidden_states: ``[T, H]`` floating.
        top_k_index: integer ``[T, k]`` expert ids.
        top_k_weights: floating ``[T, k]`` router weights (``routed_scaling_factor`` in).
        process_group: the EP group (given by ``MegaMoeEP``), or ``None`` on one rank.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype (the kernel's BF16 ``y``).
    """
    return megamoe.run_quantized(_run_kernel, self, hidden_states, top_k_index,
                                 top_k_weights, process_group)


def _run_kernel(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, process_group: Any) -> torch.Tensor:
    state = _state(self)
    _check_call(self, state, hidden_states, process_group)
    buffer = state.buffer
    capacity = buffer.num_max_tokens_per_rank
    sm90_kernel = state.kernel == "deepgemm-sm90"
    # Module globals read at call time: moewire's staging hook replaces them.
    if sm90_kernel:
        stage = stage_sm90_inputs
    elif state.mma_type == "fp4xfp4":
        stage = stage_fp4_fp4_inputs
    else:
        stage = stage_mega_moe_inputs
    # PR #323's fp8_mega_moe takes its recipe and activation by keyword.
    extra = (dict(recipe=sm90.KERNELS["fp8_mega_moe"][0], activation="swiglu") if sm90_kernel
             else dict(state.extra))
    outputs = []
    for start in range(0, hidden_states.shape[0], capacity):
        tokens = hidden_states[start : start + capacity]
        stage(
            tokens.bfloat16(), top_k_index[start : start + capacity],
            top_k_weights[start : start + capacity].float(), buffer,
        )
        y = torch.empty(tokens.shape, dtype=torch.bfloat16, device=tokens.device)
        getattr(deep_gemm, state.function)(y, state.l1, state.l2, buffer,
                                           activation_clamp=state.clamp, **extra)
        outputs.append(y)
    if not outputs:
        return torch.zeros_like(hidden_states)
    return torch.cat(outputs).to(hidden_states.dtype)
