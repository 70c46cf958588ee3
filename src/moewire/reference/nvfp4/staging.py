"""vLLM's NVFP4 staging function, in torch: :func:`prepare_megamoe_nvfp4_inputs`
(``model_executor/layers/fused_moe/prepare_megamoe.py``), which writes the routed tokens
as NVFP4 (and a fused shared expert's MXFP8 or BF16 input) into an ``NVFP4SymmBuffer``.

May import: torch and the reference modules below the ``deep_gemm`` API
(``moewire.reference._numerics``, and the family's ``_numerics`` and ``buffer``).
"""

from __future__ import annotations

from typing import Any

import torch

from moewire.reference._numerics import (
    FP8_MAX,
    ceil_to_ue8m0,
    pack_ue8m0,
)
from moewire.reference.nvfp4._numerics import (
    stage_nvfp4_per_token,
)
from moewire.reference.nvfp4.buffer import (
    SHARED_DTYPES,
    _fail,
    shared_sf_row,
)

__all__ = ["prepare_megamoe_nvfp4_inputs"]



def _check_out(where: str, name: str, t: Any, dtypes: tuple, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(where, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dtype not in dtypes:
        _fail(where, f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}",
              TypeError)
    if tuple(t.shape) != tuple(shape):
        _fail(where, f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        _fail(where, f"{name} is on {t.device}, hidden_states on {device}; use one device")


def prepare_megamoe_nvfp4_inputs(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    x: torch.Tensor,
    x_sf: torch.Tensor,
    x_scales: torch.Tensor,
    topk_idx_out: torch.Tensor,
    topk_weights_out: torch.Tensor,
    is_padding: torch.Tensor | None = None,
    shared_x: torch.Tensor | None = None,
    shared_x_sf: torch.Tensor | None = None,
    shared_block_m: int | None = None,
    w2_global_scale: torch.Tensor | None = None,
    l2_alpha: torch.Tensor | None = None,
    l2_activation_scale: float = 1.0,
    eplb_state: Any = None,
) -> None:
    """vLLM's NVFP4 Mega-MoE staging (``prepare_megamoe.py::prepare_megamoe_nvfp4_inputs``).

    Writes ``x, x_sf, x_scales`` (:func:`~moewire.reference.nvfp4._numerics.
    stage_nvfp4_per_token`: per-token FP32 scale ``amax / 2688``, E2M1 with an E4M3 scale
    per 16), ``topk_idx_out`` (int64, ``-1`` for padding tokens) and ``topk_weights_out``
    (FP32, 0 for padding); a fused shared expert's input ``shared_x``: MXFP8 (E4M3 with
    UE8M0 per 32, ``max(amax, 1e-4) * fl(1/448)`` rounded up to a power of two; scales into
    ``shared_x_sf`` at the rows of :func:`shared_sf_row` for ``shared_block_m``) when
    ``shared_x`` is FP8, else a BF16 copy. ``l2_alpha = fl(w2_global_scale *
    l2_activation_scale)`` for every local expert, written even for ``T = 0``.

    Args:
        hidden_states: ``[T, H]`` floating (BF16 in vLLM).
        topk_weights, topk_ids: ``[T, k]``.
        x: int8/uint8 ``[T, H/2]``; x_sf: int32 ``[T, H/64]``; x_scales: FP32 ``[T]``.
        topk_idx_out: int64 ``[T, k]``; topk_weights_out: FP32 ``[T, k]``.
        is_padding: bool ``[>= T]`` or None.
        shared_x: FP8 E4M3 or BF16 ``[T, H]``, or None (no fused shared expert).
        shared_x_sf: int32 ``[rows, H/128]`` with an FP8 ``shared_x``, else None.
        shared_block_m: the BLOCK_M of ``shared_x_sf``'s layout, with ``shared_x_sf``.
        w2_global_scale, l2_alpha: FP32 ``[E_local]`` each, or both None.
        l2_activation_scale: the global scale the kernel quantizes L2 inputs with.
        eplb_state: vLLM 0.34's EPLB state; only an inactive one (no
            ``logical_to_physical_map``) is supported by the stand-in.
    """
    where = "prepare_megamoe_nvfp4_inputs"
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        _fail(where, "hidden_states must be a 2-D tensor [T, H]", TypeError)
    if not hidden_states.is_floating_point():
        _fail(where, f"hidden_states must be floating, got {hidden_states.dtype}", TypeError)
    t, h = hidden_states.shape
    device = hidden_states.device
    if h % 128:
        _fail(where, f"hidden size {h} must be a multiple of 128")
    if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
        _fail(where, "topk_ids and topk_weights must be tensors", TypeError)
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        _fail(
            where,
            f"topk_ids and topk_weights must both be [T, k] with T={t}, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}",
        )
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        _fail(where, f"topk_ids must be an integer tensor, got {topk_ids.dtype}", TypeError)
    k = topk_ids.shape[1]
    _check_out(where, "x", x, (torch.int8, torch.uint8), (t, h // 2), device)
    _check_out(where, "x_sf", x_sf, (torch.int32,), (t, h // 64), device)
    _check_out(where, "x_scales", x_scales, (torch.float32,), (t,), device)
    _check_out(where, "topk_idx_out", topk_idx_out, (torch.int64,), (t, k), device)
    _check_out(where, "topk_weights_out", topk_weights_out, (torch.float32,), (t, k), device)
    shared_mxfp8 = shared_x is not None and shared_x.dtype == torch.float8_e4m3fn
    if shared_mxfp8 != (shared_x_sf is not None) or (shared_x_sf is None) != (
        shared_block_m is None
    ):
        _fail(
            where,
            "shared_x_sf and shared_block_m go together, exactly with an FP8 shared_x "
            "(a BF16 shared_x takes neither)",
        )
    if shared_x is not None:
        _check_out(where, "shared_x", shared_x, SHARED_DTYPES, (t, h), device)
    if shared_x_sf is not None:
        if isinstance(shared_block_m, bool) or not isinstance(shared_block_m, int) or (
            shared_block_m <= 0
        ):
            _fail(where, f"shared_block_m must be a positive int, got {shared_block_m!r}")
        rows = -(-t // shared_block_m) * (-(-shared_block_m // 128) * 128)
        if (
            not isinstance(shared_x_sf, torch.Tensor)
            or shared_x_sf.dtype != torch.int32
            or shared_x_sf.dim() != 2
            or shared_x_sf.shape[1] != h // 128
            or shared_x_sf.shape[0] < rows
        ):
            _fail(
                where,
                f"shared_x_sf must be int32 [>= {rows}, {h // 128}] for T={t} and "
                f"shared_block_m={shared_block_m}, got "
                + (f"{shared_x_sf.dtype} {tuple(shared_x_sf.shape)}"
                   if isinstance(shared_x_sf, torch.Tensor) else type(shared_x_sf).__name__),
            )
    if (w2_global_scale is None) != (l2_alpha is None):
        _fail(where, "pass w2_global_scale and l2_alpha together, or neither")
    if l2_alpha is not None:
        if not isinstance(l2_alpha, torch.Tensor) or l2_alpha.dtype != torch.float32:
            _fail(where, "l2_alpha must be an FP32 tensor [E_local]", TypeError)
        _check_out(where, "w2_global_scale", w2_global_scale, (torch.float32,),
                   tuple(l2_alpha.shape), l2_alpha.device)
    if not (isinstance(l2_activation_scale, (int, float)) and l2_activation_scale > 0
            and l2_activation_scale < float("inf")):
        _fail(where, f"l2_activation_scale must be a positive finite float, got "
                     f"{l2_activation_scale!r}")
    if getattr(eplb_state, "logical_to_physical_map", None) is not None:
        _fail(
            where,
            "the stand-in does not map EPLB replicas; run without EPLB (an inactive "
            "eplb_state is fine)",
            NotImplementedError,
        )
    if is_padding is not None and (
        not isinstance(is_padding, torch.Tensor) or is_padding.dim() != 1
        or is_padding.shape[0] < t
    ):
        _fail(where, f"is_padding must be a 1-D tensor with at least T={t} entries")

    if l2_alpha is not None:
        l2_alpha.copy_(w2_global_scale.float() * torch.tensor(float(l2_activation_scale)))
    if t == 0:
        return
    ids, weights = topk_ids.long(), topk_weights.float()
    if is_padding is not None:
        pad = is_padding[:t].to(device=device, dtype=torch.bool).unsqueeze(1)
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
        weights = torch.where(pad, torch.zeros_like(weights), weights)
    q, sf, scales = stage_nvfp4_per_token(hidden_states)
    x.copy_(q.view(x.dtype))
    x_sf.copy_(sf)
    x_scales.copy_(scales)
    topk_idx_out.copy_(ids)
    topk_weights_out.copy_(weights)
    if shared_x is not None:
        if shared_mxfp8:
            groups = hidden_states.float().unflatten(-1, (-1, 32))
            amax = groups.abs().amax(dim=-1).clamp(min=1e-4)
            scale = ceil_to_ue8m0(amax * torch.tensor(1.0 / FP8_MAX))
            fp8 = (groups * (1.0 / scale).unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
            shared_x.copy_(fp8)
            rows = shared_sf_row(torch.arange(t, device=device), shared_block_m)
            shared_x_sf[rows] = pack_ue8m0(scale)
        else:
            shared_x.copy_(hidden_states)
