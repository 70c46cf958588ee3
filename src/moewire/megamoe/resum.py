"""The kernel's combine sum, redone in Python from the rows left in the buffer.

Exact order of the Mega-MoE combine (DeepGEMM ``impls/sm100_fp8_fp4_mega_moe.cuh``): per token,
``acc`` starts at +0.0 in FP32; the valid routed slots (``topk_idx >= 0``) are added in ascending
slot order, ``acc += float(row)`` (``float(q(row))`` with a row quantizer: its BF16 QDQ, or its
FP32 dequantized values in ``accumulate="fp32"`` mode, as the real FP8/FP4 combines add them); a
fused shared row (stored at slot ``k`` in every build) is added first or last (its kernel's
``shared_position``, ``moewire.megamoe.flavours``); then **one** round to BF16 (nearest even). A
token with no valid row gets +0 (or its shared row). Invalid slots are *selected away*
(``torch.where``), never multiplied by a mask: their rows are stale and may hold NaN.
``acc + (+0)`` never changes ``acc`` here (``acc`` starts at +0 and a sum of finite values is
never -0), so selecting the sum is bitwise the kernel's ``acc += row`` over valid rows.

The NVFP4 kernel (``nvfp4_mega_moe`` of vLLM 0.34.0's bundled DeepGEMM) leaves **unweighted** rows
and weights them in its combine: ``acc = fma(float(row), w[t, s], acc)``, one FP32 rounding per step
(``__ffma2_rn``, ``impls/sm100_nvfp4_mega_moe.cuh`` ~l.1746-1807), the shared row last with weight
1.0 (``fma(row, 1.0, acc)`` is the FP32 add). ``resum(..., weights=w)`` does that.

DeepGEMM 2.8.0's NVFP4 x NVFP4 kernel (``fp4_fp4_mega_moe``, ``impls/sm100_fp4_fp4_mega_moe.cuh``
at 794783a) adds weighted rows, but with a fused shared row or a ``routed_scaling_factor``
``s != 1`` it rounds the routed sum to BF16, scales it by ``s`` (BF16 again) and only then adds
the shared row in FP32 before the final rounding. ``resum(..., routed_scale=s)`` does that: the
routed rows go through the same re-sum (the fused kernel included), the rest is the finish.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch

from moewire import formats, kernels
from moewire.quantizer import WireQuantizer, WireQuantizerLike

__all__ = ["SHARED_POSITIONS", "resum"]

SHARED_POSITIONS = kernels.SHARED_POSITIONS


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl(a * b + c)`` for FP32 tensors with a single rounding (CUDA's ``__fmaf_rn``).

    The product of two FP32 values is exact in float64; the float64 sum is turned into its
    round-to-odd value from the exact error term (TwoSum), and round-to-odd float64 then
    rounded to FP32 is the correctly rounded sum (53 >= 2 * 24 + 2, Boldo-Melquiond).
    No host sync (CUDA-graph capturable).
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    z = s - c64
    err = (c64 - (s - z)) + (p - z)
    inexact_even = (err != 0) & ((s.view(torch.int64) & 1) == 0) & torch.isfinite(s)
    inf = torch.full_like(s, float("inf"))
    return torch.where(inexact_even, torch.nextafter(s, torch.where(err > 0, inf, -inf)),
                       s).float()


def accumulate_mode(
    row_quantizer: Callable[[torch.Tensor], torch.Tensor] | None, accumulate: str | None
) -> str:
    """The accumulation mode of a combine: ``accumulate`` if given, else the quantizer's
    (a :class:`~moewire.quantizer.WireQuantizer` carries one; its default is its format's
    ``combine_accumulate``), else ``"bf16"``."""
    if accumulate is None:
        accumulate = (
            row_quantizer.accumulate if isinstance(row_quantizer, WireQuantizer) else "bf16"
        )
    if accumulate not in formats.ACCUMULATE_MODES:
        raise ValueError(
            f"resum: accumulate must be one of {formats.ACCUMULATE_MODES}, got {accumulate!r}"
        )
    return accumulate


def _fused_combine(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    shared_position: str | None,
    weights: torch.Tensor | None,
    row_quantizer: Callable[[torch.Tensor], torch.Tensor] | None,
    out: torch.Tensor,
    accumulate: str,
) -> bool:
    """Run ``moewire.kernels.fused_combine`` when it supports this call; True if it ran.

    The Triton kernel takes the format's row of the format table (``fmt.facts``) and an FP32
    device amax (or ``None``); it runs for a quantizer in quantize mode
    (``row_quantizer.mode == "quantize"``, its format in ``row_quantizer.fmt``, its amax in
    ``row_quantizer.static_amax``) on CUDA, when ``kernels.available()`` and
    ``kernels.supports(fmt.facts)``, for every shared position
    and for weighted sums. Everything else (CPU, plain callables, unsupported formats) takes
    the torch path below, which is the definition the kernel is tested against.
    """
    if not rows.is_cuda or getattr(row_quantizer, "mode", None) != "quantize":
        return False
    fmt = getattr(row_quantizer, "fmt", None)
    if fmt is None or fmt.facts is None:
        return False
    if not kernels.available() or not kernels.supports(fmt.facts):
        return False
    # In quantize mode the row quantizer is a wire quantizer, not a plain callable.
    row_quantizer = cast(WireQuantizerLike, row_quantizer)
    # The kernel takes an amax for global-scale formats only (fp8, nvfp4).
    amax = row_quantizer.static_amax if fmt.needs_amax else None
    kernels.fused_combine(
        rows, topk_idx, num_tokens, out, fmt.facts, amax, shared_position, weights=weights,
        accumulate=accumulate,
    )
    return True


def _resum_scaled(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    shared_position: str | None,
    row_quantizer: Callable[[torch.Tensor], torch.Tensor] | None,
    out: torch.Tensor | None,
    accumulate: str | None,
    routed_scale: float,
) -> torch.Tensor:
    """:func:`resum` of a kernel that rounds and scales its routed sum before the shared row
    (``routed_scale``; the docstring there). The routed part is an ordinary re-sum without a
    shared row (the fused kernel where it applies), into ``out`` itself when nothing follows."""
    if shared_position == "first":
        raise ValueError(
            "resum: routed_scale rounds and scales the routed sum before a shared row added "
            "last; shared_position='first' has no such step (pass routed_scale=None)"
        )
    if not (isinstance(routed_scale, (int, float)) and not isinstance(routed_scale, bool)
            and math.isfinite(routed_scale)):
        raise ValueError(f"resum: routed_scale must be a finite float, got {routed_scale!r}")
    scale = float(torch.tensor(float(routed_scale), dtype=torch.float32))
    k = topk_idx.shape[1]
    finish = shared_position is not None or scale != 1.0
    routed = resum(rows[:k], topk_idx, num_tokens, row_quantizer=row_quantizer,
                   out=None if finish else out, accumulate=accumulate)
    if not finish:
        return routed
    value = routed.float()
    if scale != 1.0:
        # The FP32 factor as a Python float multiplies FP32 values as that FP32 scalar.
        value = (value * scale).bfloat16().float()
    if shared_position == "last":
        value = value + rows[k, :num_tokens].float()
    result = value.to(torch.bfloat16)
    return result if out is None else out.copy_(result)


def resum(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    *,
    shared_position: str | None = None,
    weights: torch.Tensor | None = None,
    row_quantizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    accumulate: str | None = None,
    routed_scale: float | None = None,
) -> torch.Tensor:
    """Re-sum the combine rows in the kernel's order, optionally fake-quantizing each row.

    ``y[t] = bf16(sum_{s ascending, topk_idx[t, s] >= 0} float(q(rows[s, t])))`` with the
    FP32 sum starting at +0.0, a fused shared row ``rows[k, t]`` (never quantized) added
    first or last, and one BF16 rounding (RNE). ``q`` is ``row_quantizer`` (identity when
    ``None``); it sees the routed rows ``[k, T, H]`` of the first ``T`` tokens and must be
    row-local (its result for a row depends on that row only: the stale rows it also sees
    are then selected away without effect).

    Args:
        rows: BF16 ``[num_slots, Tmax, H]``, the combine region (``combine_rows``);
            ``num_slots = k``, or ``k + 1`` with a fused shared row at index ``k``. Without
            a ``row_quantizer`` also FP32 ``[num_slots, >= T, H]``: the values of DeepGEMM's
            FP8 combine rows (``layout.dequantize_fp8_rows``), added as they are.
        topk_idx: int ``[>= T, k]``, the staged expert ids; ``-1`` marks an invalid slot.
        num_tokens: ``T``, the tokens of this call (``y.shape[0]``).
        shared_position: ``None`` (no fused shared expert), ``"first"`` or ``"last"``: where
            the shared row is added in the sum.
        weights: ``None``: the rows are already router-weighted, ``acc += float(q(row))``
            (``fp8_fp4_mega_moe``, ``bf16_mega_moe``). FP32 ``[>= T, k]`` (the staged
            ``topk_weights``): the rows are unweighted (``nvfp4_mega_moe``),
            ``acc = fma(float(q(row)), weights[t, s], acc)`` with one FP32 rounding; the
            shared row keeps weight 1.0.
        row_quantizer: callable BF16 ``[k, T, H]`` -> BF16 ``[k, T, H]``, or ``None``.
        out: BF16 ``[T, H]`` written in place (its address is kept), or ``None`` for a new
            tensor.
        accumulate: what ``float(q(row))`` is. ``"bf16"``: the quantized row rounded to
            BF16 (ModelOpt's fake quant: QDQ to BF16, then the FP32 sum). ``"fp32"``: the
            FP32 dequantized values as they are (DeepGEMM's ``DG_USE_FP8_COMBINE``,
            TensorRT-LLM's and TransformerEngine's quantized combines dequantize into an FP32
            accumulator); a :class:`~moewire.quantizer.WireQuantizer` then gives them with
            ``dequantize``, a plain callable must return FP32. ``None``: the quantizer's
            ``accumulate`` (its format's ``combine_accumulate`` unless a recipe says
            otherwise), ``"bf16"`` for a plain callable.
        routed_scale: ``None``, or the FP32-representable factor ``s`` of a kernel that
            finishes its routed sum (``fp4_fp4_mega_moe``): ``r = bf16(routed sum)``, ``r =
            bf16(fl(r * s))`` when ``s != 1``, ``y = bf16(float(r) + shared row)`` with a
            shared row (``shared_position`` must then be ``"last"``), else ``y = r``. Needs
            ``weights=None``.

    Returns:
        ``out`` (or the new BF16 ``[T, H]`` tensor).
    """
    kernels.check_combine_args(
        "resum", rows, topk_idx, num_tokens, shared_position, out, weights,
        fp32_rows=row_quantizer is None,
    )
    if routed_scale is not None:
        if weights is not None:
            raise ValueError(
                "resum: routed_scale finishes a sum of router-weighted rows (fp4_fp4_mega_moe); "
                "a kernel that weights its rows in the combine (weights=) has no such step"
            )
        return _resum_scaled(rows, topk_idx, num_tokens, shared_position, row_quantizer, out,
                             accumulate, routed_scale)
    mode = accumulate_mode(row_quantizer, accumulate)
    if out is None:
        out = torch.empty((num_tokens, rows.shape[2]), dtype=torch.bfloat16, device=rows.device)
    if _fused_combine(rows, topk_idx, num_tokens, shared_position, weights, row_quantizer, out,
                      mode):
        return out
    k = topk_idx.shape[1]
    routed = rows[:k, :num_tokens]
    if row_quantizer is not None and mode == "fp32":
        if isinstance(row_quantizer, WireQuantizer):
            routed = row_quantizer.dequantize(routed)
        else:
            routed = row_quantizer(routed)
            if routed.dtype != torch.float32:
                raise ValueError(
                    "resum: accumulate='fp32' adds the FP32 dequantized rows, but "
                    f"row_quantizer returned {routed.dtype}; return the values before the "
                    "cast to BF16 (a WireQuantizer's dequantize), or use accumulate='bf16'"
                )
    elif row_quantizer is not None:
        routed = row_quantizer(routed)
    valid = (topk_idx[:num_tokens] >= 0).unsqueeze(-1)
    acc = torch.zeros((num_tokens, rows.shape[2]), dtype=torch.float32, device=rows.device)
    if shared_position == "first":
        acc = acc + rows[k, :num_tokens].float()
    for s in range(k):
        if weights is None:
            added = acc + routed[s].float()
        else:
            added = _fma_f32(routed[s].float(), weights[:num_tokens, s : s + 1], acc)
        acc = torch.where(valid[:, s], added, acc)
    if shared_position == "last":
        acc = acc + rows[k, :num_tokens].float()
    return out.copy_(acc.to(torch.bfloat16))
