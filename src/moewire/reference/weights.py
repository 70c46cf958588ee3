"""Seeded random Mega-MoE weights in the kernel's formats, and a plain shared-expert MLP.

Weight formats (what :func:`moewire.reference.deep_gemm.fp8_fp4_mega_moe` reads):

- Routed experts, ``fp8xfp4``: FP4 E2M1 codes packed two per byte (int8, element ``2j`` in
  the low nibble) with one UE8M0 scale per 32 along K, packed four per int32 (byte ``j`` of
  int ``i`` is group ``4i + j``): L1 ``(int8 [E, 2I, H/2], int32 [E, 2I, H/128])`` with
  rows ``[gate | up]``; L2 ``(int8 [E, H, I/2], int32 [E, H, I/128])``. The kernel takes
  them after :func:`~moewire.reference.deep_gemm.transform_weights_for_mega_moe`.
- A fused shared expert, ``fp8xfp4``: FP8 E4M3 with UE8M0 per 32 (as DeepGEMM's tests and
  DeepSeek-V4 checkpoints keep shared experts in FP8): ``(FP8 [2Is, H], int32 [2Is,
  H/128])`` and ``(FP8 [H, Is], int32 [H, Is/128])``, ``Is = num_shared * I``.
- ``bf16xbf16``: BF16 ``[E, 2I, H]`` and ``[E, H, I]`` (shared: ``[2Is, H]``, ``[H, Is]``).

May import: torch, ``moewire.reference.deep_gemm`` (the API) and ``_numerics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moewire.reference import deep_gemm
from moewire.reference._numerics import cast_to_fp8_ue8m0, pack_ue8m0, quantize_fp4_ue8m0

_SHARED_SEED_OFFSET = 1 << 20


@dataclass
class MegaMoEWeights:
    """Expert weights of one rank (or any subset of experts).

    Attributes:
        experts: the global expert ids held, in order.
        mma_type: ``"fp8xfp4"`` or ``"bf16xbf16"``.
        l1, l2: kernel format, transformed for the kernel.
        l1_raw, l2_raw: the same before the transform (L1 rows ``[gate | up]``, scale rows in
            natural order), for oracles that dequantize on their own.
        shared_l1, shared_l2, shared_l1_raw, shared_l2_raw: a fused shared expert, or None.
    """

    experts: tuple[int, ...]
    mma_type: str
    l1: Any
    l2: Any
    l1_raw: Any
    l2_raw: Any
    shared_l1: Any = None
    shared_l2: Any = None
    shared_l1_raw: Any = None
    shared_l2_raw: Any = None


def _dense(seed: int, rows: int, cols: int, outliers: int, outlier_scale: float) -> torch.Tensor:
    """FP32 ``[rows, cols]``, N(0, 1/cols), with ``outliers`` input channels scaled up.

    Real expert weights have a few input channels (columns) far larger than the rest; the
    per-32 scales must cope with a group that holds one.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((rows, cols), generator=gen) / cols**0.5
    if outliers:
        channels = torch.randperm(cols, generator=gen)[:outliers]
        w[:, channels] *= outlier_scale
    return w


def _quantize(w: torch.Tensor, fmt: str) -> Any:
    if fmt == "fp4":
        return quantize_fp4_ue8m0(w)
    if fmt == "fp8":
        q, sf = cast_to_fp8_ue8m0(w, 32)
        return q, pack_ue8m0(sf)
    return w.bfloat16()


def _rows(w: Any, perm: torch.Tensor) -> Any:
    if isinstance(w, tuple):
        return tuple(t[perm] for t in w)
    return w[perm]


def _stack(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(torch.stack([p[j] for p in parts]) for j in range(len(parts[0])))
    return torch.stack(parts)


def _to(w: Any, device: torch.device) -> Any:
    if isinstance(w, tuple):
        return tuple(t.to(device) for t in w)
    return w.to(device)


def expert_ids(num_experts: int, experts: Iterable[int] | None, maker: str) -> tuple[int, ...]:
    """The global expert ids to build (default all); ``maker`` names the builder in errors.

    Raises:
        ValueError: ``experts`` is empty or leaves ``range(num_experts)``.
    """
    ids = tuple(range(num_experts)) if experts is None else tuple(int(e) for e in experts)
    if not ids or any(not 0 <= e < num_experts for e in ids):
        raise ValueError(
            f"{maker}: experts must be a non-empty subset of range({num_experts}), got {ids}"
        )
    return ids


def dense_expert(seed: int, expert: int, hidden: int, intermediate: int, outlier_channels: int,
                 outlier_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 L1 ``[2I, H]`` and L2 ``[H, I]`` of one expert, drawn from its own seed
    ``seed * 1000003 + expert`` (so a rank's subset equals a one-rank build)."""
    seed_e = (seed * 1000003 + expert) * 2
    return (_dense(seed_e, 2 * intermediate, hidden, outlier_channels, outlier_scale),
            _dense(seed_e + 1, hidden, intermediate, outlier_channels, outlier_scale))


#: One expert's dense ``(l1 [2I, H], l2 [H, I])`` to its quantized form: ``(l1 codes, l1
#: block scales, l1 global scale(s), l2 codes, l2 block scales, l2 global scale)``.
ExpertQuantizer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def quantized_weights(holder: Callable[..., Any], quantize_expert: ExpertQuantizer,
                      dense: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      experts: tuple[int, ...], device: torch.device) -> Any:
    """The weights holder of quantized experts with global scales (the NVFP4 families).

    Args:
        holder: its class, called ``holder(experts, l1, l2, l1_raw, l2_raw, l1_scale,
            l2_scale)``.
        quantize_expert: one expert's quantization (:data:`ExpertQuantizer`).
        dense: each expert's dense ``(l1, l2)``, in the order of ``experts`` (quantized one
            at a time, so a large build holds one dense expert at once).
        experts: the global expert ids; device: where the tensors go (then the kernel's
            layout transform, ``deep_gemm.transform_weights_for_mega_moe``, runs there).
    """
    parts = [quantize_expert(l1, l2) for l1, l2 in dense]
    w1, sf1, gs1, w2, sf2, gs2 = (torch.stack([p[j] for p in parts]).to(device)
                                  for j in range(6))
    l1_raw, l2_raw = (w1, sf1), (w2, sf2)
    l1, l2 = deep_gemm.transform_weights_for_mega_moe(l1_raw, l2_raw)
    return holder(experts, l1, l2, l1_raw, l2_raw, gs1, gs2)


def add_shared_expert(weights: Any, num_shared_experts: int, hidden: int, intermediate: int,
                      seed: int, outlier_channels: int, outlier_scale: float, fmt: str,
                      device: torch.device) -> None:
    """Give ``weights`` a fused shared expert of ``num_shared_experts * I`` in ``fmt``
    (``"fp8"`` or ``"bf16"``): its ``shared_l1_raw``/``shared_l2_raw`` and, transformed for
    the kernel, ``shared_l1``/``shared_l2``."""
    shared_i = num_shared_experts * intermediate
    base = (seed * 1000003 + _SHARED_SEED_OFFSET) * 2
    s1 = _quantize(_dense(base, 2 * shared_i, hidden, outlier_channels, outlier_scale), fmt)
    s2 = _quantize(_dense(base + 1, hidden, shared_i, outlier_channels, outlier_scale), fmt)
    weights.shared_l1_raw, weights.shared_l2_raw = _to(s1, device), _to(s2, device)
    weights.shared_l1, weights.shared_l2 = deep_gemm.transform_weights_for_mega_moe(
        weights.shared_l1_raw, weights.shared_l2_raw
    )


def make_weights(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    experts: Iterable[int] | None = None,
    mma_type: str = "fp8xfp4",
    num_shared_experts: int = 0,
    seed: int = 0,
    outlier_channels: int = 4,
    outlier_scale: float = 16.0,
    distinct: int | None = None,
    device: torch.device | str = "cpu",
) -> MegaMoEWeights:
    """Seeded random expert weights in the kernel's formats.

    Expert ``e`` is drawn from its own generator (seed ``seed * 1000003 + e``), so a rank
    that builds only its own experts gets the same weights as a one-rank build. L1 is
    ``[gate | up]`` ``[2I, H]``, L2 ``[H, I]``; each has ``outlier_channels`` input channels
    ``outlier_scale`` times larger.

    ``distinct=n`` is a shortcut for large shapes (drawing and quantizing 256 experts of
    V4-Flash takes minutes on a small CPU): only ``n`` base experts are drawn and
    quantized, and expert ``e`` is base ``e % n`` with its output rows shuffled by its own
    seeded permutation (same formats and outlier channels; experts are then correlated).

    Args:
        num_experts: routed experts in the model (bounds ``experts``).
        hidden: H; intermediate: I per expert.
        experts: the global ids to build (default: all).
        mma_type: ``"fp8xfp4"`` (routed FP4, shared FP8) or ``"bf16xbf16"``.
        num_shared_experts: > 0 builds one fused shared expert of ``num_shared * I``.
        seed: base seed.
        outlier_channels, outlier_scale: the outlier structure.
        device: where the tensors go.

    Returns:
        A :class:`MegaMoEWeights`.
    """
    if mma_type not in deep_gemm.MMA_TYPES:
        raise ValueError(f"make_weights: unknown mma_type {mma_type!r}; use {deep_gemm.MMA_TYPES}")
    ids = expert_ids(num_experts, experts, "make_weights")
    if distinct is not None and (not isinstance(distinct, int) or distinct < 1):
        raise ValueError(f"make_weights: distinct must be a positive int or None, got {distinct!r}")
    fp8 = mma_type == "fp8xfp4"
    fmt = "fp4" if fp8 else "bf16"
    device = torch.device(device)
    bases: dict[int, tuple[Any, Any]] = {}

    def expert_weights(e: int) -> tuple[Any, Any]:
        source = e if distinct is None else e % distinct
        if source not in bases:
            dense = dense_expert(seed, source, hidden, intermediate, outlier_channels,
                                 outlier_scale)
            bases[source] = (_quantize(dense[0], fmt), _quantize(dense[1], fmt))
        l1, l2 = bases[source]
        if distinct is None:
            return l1, l2
        gen = torch.Generator().manual_seed((seed * 1000003 + e) * 2 + 1)
        return _rows(l1, torch.randperm(2 * intermediate, generator=gen)), _rows(
            l2, torch.randperm(hidden, generator=gen)
        )

    l1_parts, l2_parts = [], []
    for e in ids:
        l1, l2 = expert_weights(e)
        l1_parts.append(l1)
        l2_parts.append(l2)
    l1_raw, l2_raw = _to(_stack(l1_parts), device), _to(_stack(l2_parts), device)
    l1, l2 = deep_gemm.transform_weights_for_mega_moe(l1_raw, l2_raw)
    weights = MegaMoEWeights(ids, mma_type, l1, l2, l1_raw, l2_raw)
    if num_shared_experts:
        add_shared_expert(weights, num_shared_experts, hidden, intermediate, seed,
                          outlier_channels, outlier_scale, "fp8" if fp8 else "bf16", device)
    return weights


class SharedExpert(nn.Module):
    """A plain SwiGLU MLP, for an unfused shared expert: ``down(silu(gate) * up)``.

    ``gate_up_proj``: ``[2I, H]`` (rows ``[gate | up]``), ``down_proj``: ``[H, I]``, no bias,
    seeded N(0, 1/fan_in) weights in ``dtype``; the matmuls run in ``dtype``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        seed: int = 0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, device=device,
                                      dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        base = (seed * 1000003 + 2 * _SHARED_SEED_OFFSET) * 2
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(_dense(base, 2 * intermediate, hidden, 0, 1.0))
            self.down_proj.weight.copy_(_dense(base + 1, hidden, intermediate, 0, 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, H]`` -> ``[T, H]`` in ``dtype``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)
