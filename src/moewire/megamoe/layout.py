"""Where the combine rows live: a BF16 view of a Mega-MoE buffer's combine region."""

from __future__ import annotations

import os
from typing import Any

import torch

from moewire.megamoe import flavours as _flavours

__all__ = ["combine_rows", "holds_fp8_combine"]

# sgl-deep-gemm 0.2.5's switch of its FP8 combine: its C++ sizes the buffer and its JIT
# builds the kernel from it (`kUseFp8Combine`).
ENV_FP8_COMBINE = "DG_USE_FP8_COMBINE"


def holds_fp8_combine(symm_buffer: Any) -> bool:
    """Whether the buffer's combine rows are DeepGEMM's FP8 ones: the buffer says so
    (``use_fp8_combine``, moewire's stand-in), or, for a buffer that does not, the process
    runs with ``DG_USE_FP8_COMBINE=1`` (what sizes sgl-deep-gemm's buffer)."""
    flag = getattr(symm_buffer, "use_fp8_combine", None)
    if isinstance(flag, bool):
        return flag
    return os.environ.get(ENV_FP8_COMBINE, "0").strip() == "1"


def _int_field(symm_buffer: Any, field: str, where: str) -> int:
    value = getattr(symm_buffer, field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{where}: the symmetric buffer needs a positive int `{field}`, got "
            f"{value!r}; pass the SymmBuffer from get_symm_buffer_for_mega_moe"
        )
    return value


def combine_rows(
    symm_buffer: Any,
    flavour: str | _flavours.Flavour,
    kernel: str,
    *,
    fused_shared: bool = False,
) -> torch.Tensor:
    """The combine region ``kernel`` of build ``flavour`` leaves in ``symm_buffer`` (no copy).

    The region is BF16 ``[num_slots][Tmax][H]``, slot-major: row (slot ``s``, token ``t``)
    starts at byte ``base + (s * Tmax + t) * 2H`` of ``symm_buffer.buffer``, where ``base``
    is given by the kernel's base rule and ``num_slots = num_topk + fused_shared``: routed
    slot ``s`` at index ``s``, a fused shared expert at index ``k`` in every build
    (DeepGEMM ``layout/mega_moe.cuh``).
    ``Tmax`` is read from ``symm_buffer.num_max_tokens_per_rank`` (the rounded-up capacity).

    Args:
        symm_buffer: a DeepGEMM ``SymmBuffer`` (``buffer``: int8 ``[nbytes]``,
            ``num_max_tokens_per_rank``, ``num_topk``, ``hidden``, and the views the base
            rule reads).
        flavour: a flavour name or :class:`~moewire.megamoe.flavours.Flavour`.
        kernel: the kernel function that wrote the rows (``"fp8_fp4_mega_moe"``).
        fused_shared: a shared expert is fused into the kernel (one extra slot).

    Returns:
        BF16 ``[num_slots, Tmax, H]``, a view of ``symm_buffer.buffer``.

    Raises:
        ValueError: the build has no such kernel, the kernel fuses no shared expert but
            ``fused_shared`` is set, the region does not fit the buffer (the message
            names the flavour and the sizes), or the buffer holds DeepGEMM's FP8 combine
            rows (:func:`holds_fp8_combine`), which a BF16 view would misread.
    """
    flav = _flavours.get(flavour)
    layout = flav.layout(kernel)
    where = f"flavour {flav.name!r}, {kernel}"
    if holds_fp8_combine(symm_buffer):
        raise ValueError(
            f"{where}: the buffer holds DeepGEMM's FP8 combine rows ({ENV_FP8_COMBINE}=1: "
            "E4M3 bytes and a UE8M0 byte per 128 columns), not BF16 rows; the kernel already "
            "quantizes its combine, so a combine quantizer on top would quantize twice and "
            f"is refused. Study that combine with the deepgemm_fp8_combine recipe on a BF16 "
            f"build (unset {ENV_FP8_COMBINE}), or disable the combine quantizer"
        )
    if fused_shared and layout.shared_position is None:
        raise ValueError(
            f"{where}: this kernel fuses no shared expert in this build, but the module fuses "
            f"one; use the flavour of the kernel build (known: {', '.join(_flavours.names())})"
        )
    tmax = _int_field(symm_buffer, "num_max_tokens_per_rank", where)
    hidden = _int_field(symm_buffer, "hidden", where)
    slots = _int_field(symm_buffer, "num_topk", where) + (1 if fused_shared else 0)
    nbytes = slots * tmax * hidden * 2
    flat = _flavours.flat_buffer(symm_buffer, where)
    base = layout.combine_base(symm_buffer, nbytes, where)
    if base < 0 or base + nbytes > flat.numel() or base % 2:
        raise ValueError(
            f"{where}: the combine region [{slots} slots x {tmax} tokens x {hidden} hidden] "
            f"BF16 = {nbytes} bytes at byte offset {base} ({layout.base_rule}) does not fit "
            f"the {flat.numel()}-byte buffer (or is not 2-byte aligned); the buffer was built "
            "for other shapes or another kernel build: check the flavour and the buffer's fields"
        )
    return flat[base : base + nbytes].view(torch.bfloat16).view(slots, tmax, hidden)
