"""Bytes on the wire per token, from each format's ``WireFormat.wire_bits``.

A token routed to ``k`` experts crosses the wire ``k`` times each way: the dispatch sends
one copy of its hidden vector per routed slot, and the combine sends one row back per
slot. So, for hidden size ``H``::

    dispatch_bytes = k * wire_bits_dispatch(H) / 8
    combine_bytes  = k * wire_bits_combine(H) / 8
    bytes_per_token = dispatch_bytes + combine_bytes
    ratio_to_bf16  = bytes_per_token / (2 * k * 16 * H / 8)

``bf16`` (no quantizer) counts 16 bits per element. These are the bytes of the formats
themselves; with several EP ranks a copy whose expert sits on the token's own rank does
not leave the rank, which :func:`remote_fraction` measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moewire import formats


@dataclass(frozen=True)
class WireCost:
    """Bytes per token of one dispatch x combine pair (see the module docstring)."""

    dispatch_bytes_per_token: float
    combine_bytes_per_token: float
    bytes_per_token: float
    ratio_to_bf16: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def format_bits(name: str, hidden: int) -> float:
    """Bits of one row of ``hidden`` elements in format ``name`` (``bf16``: ``16 * hidden``)."""
    return float(formats.get(name).wire_bits(hidden))


def wire_cost(dispatch: str, combine: str, hidden: int, top_k: int) -> WireCost:
    """Bytes per token of a dispatch/combine pair with ``top_k`` copies each way."""
    d = top_k * format_bits(dispatch, hidden) / 8.0
    c = top_k * format_bits(combine, hidden) / 8.0
    bf16 = 2.0 * top_k * 16.0 * hidden / 8.0
    return WireCost(d, c, d + c, (d + c) / bf16)


def remote_fraction(
    topk_ids: torch.Tensor, num_experts: int, num_ranks: int, tokens_per_rank: int
) -> float:
    """Fraction of routed (token, slot) copies whose expert lives on another EP rank.

    Experts are split evenly and in order (expert ``e`` on rank ``e // (E / R)``, as
    DeepGEMM does); token ``t`` of a batch sits on rank ``t // tokens_per_rank``.
    Slots with ``id < 0`` (padding) are not counted.

    Args:
        topk_ids: int64 ``[T, k]``.
        num_experts: ``E``, divisible by ``num_ranks``.
        num_ranks: ``R``.
        tokens_per_rank: tokens each rank holds (``T = R * tokens_per_rank``).

    Returns:
        A float in ``[0, 1]`` (0 with one rank or no routed copy).
    """
    valid = topk_ids >= 0
    total = int(valid.sum())
    if num_ranks == 1 or total == 0:
        return 0.0
    expert_rank = topk_ids.clamp(min=0) // (num_experts // num_ranks)
    token_rank = (torch.arange(topk_ids.shape[0]) // tokens_per_rank).unsqueeze(1)
    remote = (expert_rank != token_rank.to(topk_ids.device)) & valid
    return int(remote.sum()) / total
