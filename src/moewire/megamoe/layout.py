"""Where the combine rows live: a BF16 view of a Mega-MoE buffer's combine region."""

from __future__ import annotations

import os
from typing import Any

import torch

from moewire.megamoe import flavours as _flavours

__all__ = ["combine_fp8_rows", "combine_rows", "dequantize_fp8_rows", "holds_fp8_combine"]

# sgl-deep-gemm 0.2.5's switch of its FP8 combine: its C++ sizes the buffer and its JIT
# builds the kernel from it (`kUseFp8Combine`).
ENV_FP8_COMBINE = "DG_USE_FP8_COMBINE"
# Its FP8 combine tiles each row by 128 columns, one UE8M0 byte per tile.
FP8_COMBINE_TILE = 128


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
    where = f"flavour {flav.name!r}, {kernel}"
    if holds_fp8_combine(symm_buffer):
        raise ValueError(
            f"{where}: the buffer holds DeepGEMM's FP8 combine rows ({ENV_FP8_COMBINE}=1: "
            "E4M3 bytes and a UE8M0 byte per 128 columns), not BF16 rows, which a BF16 view "
            "would misread; read them with combine_fp8_rows, or build the buffer with "
            f"{ENV_FP8_COMBINE} unset"
        )
    flat, base, (slots, tmax, hidden) = _region(symm_buffer, flav, kernel, fused_shared)
    nbytes = slots * tmax * hidden * 2
    return flat[base : base + nbytes].view(torch.bfloat16).view(slots, tmax, hidden)


def combine_fp8_rows(
    symm_buffer: Any,
    flavour: str | _flavours.Flavour,
    kernel: str,
    *,
    fused_shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's FP8 combine rows (``DG_USE_FP8_COMBINE=1``) in ``symm_buffer`` (no copy).

    sgl-deep-gemm 0.2.5 (``include/deep_gemm/layout/mega_moe.cuh``, its combine token
    buffer with ``use_fp8_combine``; written by the L2 epilogue of
    ``impls/sm100_fp8_fp4_mega_moe.cuh``): at the kernel's combine base, the E4M3 bytes
    ``[num_slots][Tmax][H]`` (slot-major, ``H`` bytes a row), then right after them the
    UE8M0 bytes ``[num_slots][Tmax][H / 128]``, one per (slot, token, 128 columns) in the
    same order. The base is the kernel's base rule applied to the whole
    ``num_slots * Tmax * (H + H / 128)`` bytes. :func:`dequantize_fp8_rows` gives the
    values the combine reduce adds.

    Args:
        symm_buffer: a DeepGEMM ``SymmBuffer`` that holds FP8 combine rows
            (:func:`holds_fp8_combine`).
        flavour: a flavour name or :class:`~moewire.megamoe.flavours.Flavour`.
        kernel: the kernel function that wrote the rows (``"fp8_fp4_mega_moe"``).
        fused_shared: a shared expert is fused into the kernel (one extra slot).

    Returns:
        ``(q, sf)``: float8_e4m3fn ``[num_slots, Tmax, H]`` and uint8
        ``[num_slots, Tmax, H / 128]``, views of ``symm_buffer.buffer``.

    Raises:
        ValueError: the buffer holds BF16 combine rows, ``H`` is not a multiple of 128, or
            any refusal of :func:`combine_rows` (unknown kernel, no fused shared expert,
            a region that does not fit the buffer).
    """
    flav = _flavours.get(flavour)
    where = f"flavour {flav.name!r}, {kernel}"
    if not holds_fp8_combine(symm_buffer):
        raise ValueError(
            f"{where}: the buffer holds BF16 combine rows ({ENV_FP8_COMBINE} is not 1 for it), "
            "not FP8 ones; read them with combine_rows"
        )
    hidden = _int_field(symm_buffer, "hidden", where)
    if hidden % FP8_COMBINE_TILE:
        raise ValueError(
            f"{where}: hidden={hidden} is not a multiple of {FP8_COMBINE_TILE}, the FP8 "
            "combine's scale tile; this buffer cannot hold DeepGEMM's FP8 combine rows"
        )
    per_row = hidden + hidden // FP8_COMBINE_TILE
    flat, base, (slots, tmax, _) = _region(symm_buffer, flav, kernel, fused_shared, fp8=True)
    rows = slots * tmax * hidden
    q = flat[base : base + rows].view(torch.float8_e4m3fn).view(slots, tmax, hidden)
    sf = flat[base + rows : base + slots * tmax * per_row].view(torch.uint8)
    return q, sf.view(slots, tmax, hidden // FP8_COMBINE_TILE)


def dequantize_fp8_rows(q: torch.Tensor, sf: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The values DeepGEMM's FP8 combine reduce adds for the first ``num_tokens`` tokens.

    ``v[s, t, c] = float(q[s, t, c]) * 2^(sf[s, t, c // 128] - 127)``, exact in FP32 (an E4M3
    value has 4 significant bits; the smallest product, ``2^-9 * 2^-127``, is an FP32
    subnormal). The kernel's reduce (``impls/sm100_fp8_fp4_mega_moe.cuh``, sgl-deep-gemm
    0.2.5) adds ``fma(float(q), scale, acc)`` with the scale ``fast_pow2(byte - 127)``: with
    an exact product that is ``acc + v``. Byte 0 is the bit pattern of +0.0 there, and only
    an all-zero tile has it, so the product is 0 either way.

    Args:
        q: float8_e4m3fn ``[num_slots, Tmax, H]`` (:func:`combine_fp8_rows`).
        sf: uint8 ``[num_slots, Tmax, H / 128]``.
        num_tokens: ``T``, the tokens of the call (``<= Tmax``).

    Returns:
        FP32 ``[num_slots, T, H]`` (a new tensor).
    """
    values = q[:, :num_tokens].double().unflatten(-1, (-1, FP8_COMBINE_TILE))
    scale = torch.pow(2.0, sf[:, :num_tokens].double() - 127).unsqueeze(-1)
    rows: torch.Tensor = (values * scale).flatten(-2).float()
    return rows


def _region(
    symm_buffer: Any,
    flav: _flavours.Flavour,
    kernel: str,
    fused_shared: bool,
    fp8: bool = False,
) -> tuple[torch.Tensor, int, tuple[int, int, int]]:
    """The flat buffer, the combine base and ``(slots, Tmax, H)`` of a combine region of
    ``slots * Tmax`` rows of ``2H`` bytes (BF16), or of ``H + H / 128`` bytes with ``fp8``
    (refusals as :func:`combine_rows`)."""
    layout = flav.layout(kernel)
    where = f"flavour {flav.name!r}, {kernel}"
    if fused_shared and layout.shared_position is None:
        raise ValueError(
            f"{where}: this kernel fuses no shared expert in this build, but the module fuses "
            f"one; use the flavour of the kernel build (known: {', '.join(_flavours.names())})"
        )
    tmax = _int_field(symm_buffer, "num_max_tokens_per_rank", where)
    hidden = _int_field(symm_buffer, "hidden", where)
    slots = _int_field(symm_buffer, "num_topk", where) + (1 if fused_shared else 0)
    nbytes = slots * tmax * (hidden + hidden // FP8_COMBINE_TILE if fp8 else 2 * hidden)
    flat = _flavours.flat_buffer(symm_buffer, where)
    base = layout.combine_base(symm_buffer, nbytes, where)
    if base < 0 or base + nbytes > flat.numel() or base % 2:
        raise ValueError(
            f"{where}: the combine region [{slots} slots x {tmax} tokens x {hidden} hidden] "
            f"= {nbytes} bytes at byte offset {base} ({layout.base_rule}) does not fit "
            f"the {flat.numel()}-byte buffer (or is not 2-byte aligned); the buffer was built "
            "for other shapes or another kernel build: check the flavour and the buffer's fields"
        )
    return flat, base, (slots, tmax, hidden)
