"""Where the combine rows live: a BF16 view of a Mega-MoE buffer's combine region."""

from __future__ import annotations

from typing import Any

import torch

from moewire.megamoe import flavours as _flavours

__all__ = ["combine_rows"]


def _int_field(symm_buffer: Any, field: str, flavour: str) -> int:
    value = getattr(symm_buffer, field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"flavour {flavour!r}: the symmetric buffer needs a positive int `{field}`, got "
            f"{value!r}; pass the SymmBuffer from get_symm_buffer_for_mega_moe"
        )
    return value


def combine_rows(
    symm_buffer: Any, flavour: str | _flavours.Flavour, *, fused_shared: bool = False
) -> torch.Tensor:
    """The combine region of ``symm_buffer`` as a BF16 view (no copy).

    The region is BF16 ``[num_slots][Tmax][H]``, slot-major: row (slot ``s``, token ``t``)
    starts at byte ``base + (s * Tmax + t) * 2H`` of ``symm_buffer.buffer``, where ``base`` is
    given by the flavour's rule and ``num_slots = num_topk + fused_shared``. ``Tmax`` is read
    from ``symm_buffer.num_max_tokens_per_rank`` (the rounded-up capacity).

    Args:
        symm_buffer: a DeepGEMM ``SymmBuffer`` (``buffer``: int8 ``[nbytes]``,
            ``num_max_tokens_per_rank``, ``num_topk``, ``hidden``, and the views the flavour's
            rule reads).
        flavour: a flavour name or :class:`~moewire.megamoe.flavours.Flavour`.
        fused_shared: a shared expert is fused into the kernel (one extra slot).

    Returns:
        BF16 ``[num_slots, Tmax, H]``, a view sharing ``symm_buffer.buffer``'s storage.

    Raises:
        ValueError: the flavour fuses no shared expert but ``fused_shared`` is set, or the
            region does not fit the buffer (the message names the flavour and the sizes).
    """
    flav = _flavours.get(flavour)
    if fused_shared and flav.shared_slot is None:
        raise ValueError(
            f"flavour {flav.name!r} has no fused shared expert slot, but the module fuses one; "
            "use the flavour of the kernel build (vllm: shared last, sgl: shared first)"
        )
    tmax = _int_field(symm_buffer, "num_max_tokens_per_rank", flav.name)
    hidden = _int_field(symm_buffer, "hidden", flav.name)
    slots = _int_field(symm_buffer, "num_topk", flav.name) + (1 if fused_shared else 0)
    nbytes = slots * tmax * hidden * 2
    flat = _flavours._flat_buffer(symm_buffer, flav.name)
    base = flav.combine_base(symm_buffer, nbytes)
    if base < 0 or base + nbytes > flat.numel() or base % 2:
        raise ValueError(
            f"flavour {flav.name!r}: the combine region [{slots} slots x {tmax} tokens x "
            f"{hidden} hidden] BF16 = {nbytes} bytes at byte offset {base} does not fit the "
            f"{flat.numel()}-byte buffer (or is not 2-byte aligned); the buffer was built for "
            "other shapes or another kernel build: check the flavour and the buffer's fields"
        )
    return flat[base : base + nbytes].view(torch.bfloat16).view(slots, tmax, hidden)
