"""The combine kernel's entry point: :func:`fused_combine` (fake-quantize and re-sum the
combine rows in one pass, with the layout check and the calibration max on request), and
:func:`check_combine_args`, the argument checks it shares with ``megamoe.resum``."""

from __future__ import annotations

import torch

from moewire.format_table import FormatFacts
from moewire.kernels import tuning
from moewire.kernels.launch import (
    ACCUMULATE_MODES,
    SHARED_POSITIONS,
    _amax_tensor,
    _check_blocks,
    _check_device,
    _check_format,
    _desc,
    _impl,
    _triton_mod,
)

__all__ = ["check_combine_args", "fused_combine"]


def _is_tensor(t: object, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``t`` is a tensor of ``dtype`` on ``device`` (the rows' device)."""
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device


def check_combine_args(
    where: str,
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    shared_position: str | None,
    out: torch.Tensor | None,
    weights: torch.Tensor | None = None,
    fp32_rows: bool = False,
) -> None:
    """Validate the arguments of a combine re-sum (shared by ``megamoe.resum`` and
    :func:`fused_combine`); ``where`` names the caller in the message. Device-agnostic:
    the kernel adds its own device and stride checks. ``fp32_rows``: FP32 rows (the
    dequantized rows of DeepGEMM's FP8 combine) are accepted too."""
    dtypes = (torch.bfloat16, torch.float32) if fp32_rows else (torch.bfloat16,)
    if not isinstance(rows, torch.Tensor) or rows.dtype not in dtypes or rows.dim() != 3:
        kinds = "BF16 or FP32" if fp32_rows else "BF16"
        raise ValueError(
            f"{where}: rows must be a {kinds} tensor [num_slots, Tmax, H] (the combine region "
            f"from combine_rows), got {_desc(rows)}"
        )
    if (
        not isinstance(topk_idx, torch.Tensor)
        or topk_idx.dim() != 2
        or topk_idx.is_floating_point()
    ):
        raise ValueError(
            f"{where}: topk_idx must be an integer tensor [>= T, k], got {_desc(topk_idx)}"
        )
    if shared_position not in SHARED_POSITIONS:
        raise ValueError(
            f"{where}: shared_position must be None, 'first' or 'last', got "
            f"{shared_position!r}"
        )
    k = topk_idx.shape[1]
    expected = k + (shared_position is not None)
    if rows.shape[0] != expected:
        raise ValueError(
            f"{where}: rows has {rows.shape[0]} slots but topk_idx has k={k} and "
            f"shared_position={shared_position!r}, which needs {expected} (a fused shared row "
            "is stored at row k); pass fused_shared to combine_rows exactly when the kernel "
            "fuses a shared expert"
        )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"{where}: num_tokens must be an int, got {type(num_tokens).__name__}")
    limit = min(rows.shape[1], topk_idx.shape[0])
    if not 0 <= num_tokens <= limit:
        raise ValueError(
            f"{where}: num_tokens={num_tokens} must lie in [0, {limit}]"
            f" (rows hold {rows.shape[1]} tokens, topk_idx {topk_idx.shape[0]})"
        )
    if topk_idx.device != rows.device:
        raise ValueError(f"{where}: topk_idx is on {topk_idx.device}, rows on {rows.device}")
    if weights is not None and (
        not _is_tensor(weights, torch.float32, rows.device)
        or weights.dim() != 2
        or weights.shape[1] != k
        or weights.shape[0] < num_tokens
    ):
        raise ValueError(
            f"{where}: weights must be the staged router weights, FP32 [>= {num_tokens}, {k}] "
            f"on {rows.device} (the buffer's topk_weights), got {_desc(weights)}"
        )
    if out is not None:
        want = (num_tokens, rows.shape[2])
        if not _is_tensor(out, torch.bfloat16, rows.device) or tuple(out.shape) != want:
            raise ValueError(
                f"{where}: out must be BF16 {list(want)} on {rows.device} (the kernel's y), "
                f"got {_desc(out)}"
            )


def _check_kernel_args(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor,
    shared_position: str | None,
    check_against: torch.Tensor | None,
    check_flag: torch.Tensor | None,
    calib_amax: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> None:
    where = "moewire.kernels.fused_combine"
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{where}: out must be a BF16 tensor [T, H], got {_desc(out)}")
    check_combine_args(where, rows, topk_idx, num_tokens, shared_position, out, weights)
    _check_device(rows, "rows")
    if rows.stride(2) != 1:
        raise ValueError(
            f"{where}: rows must be contiguous along H (a view of the combine region), got "
            f"strides {rows.stride()}"
        )
    want = (num_tokens, rows.shape[2])
    for name, t in (("out", out), ("check_against", check_against)):
        if t is None:
            continue
        if (
            not _is_tensor(t, torch.bfloat16, rows.device)
            or tuple(t.shape) != want
            or t.stride(1) != 1
        ):
            raise ValueError(
                f"{where}: {name} must be BF16 {list(want)} on {rows.device}, contiguous along "
                f"H, got {_desc(t)}"
            )
    if (check_against is None) != (check_flag is None):
        raise ValueError(f"{where}: pass check_against and check_flag together, or neither")
    for name, t, dtype in (("check_flag", check_flag, torch.int32),
                           ("calib_amax", calib_amax, torch.float32)):
        if t is not None and (not _is_tensor(t, dtype, rows.device) or t.numel() < 1):
            raise ValueError(
                f"{where}: {name} must be a {dtype} device tensor (one element is used) on "
                f"{rows.device}, got {_desc(t)}"
            )


def fused_combine(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor,
    fmt: FormatFacts | str,
    amax: torch.Tensor | float | None,
    shared_position: str | None,
    check_against: torch.Tensor | None = None,
    check_flag: torch.Tensor | None = None,
    calib_amax: torch.Tensor | None = None,
    *,
    weights: torch.Tensor | None = None,
    accumulate: str = "bf16",
    block_h: int | None = None,
    num_warps: int | None = None,
    unroll: bool | None = None,
) -> torch.Tensor:
    """Fake-quantize and re-sum the combine rows in one pass, the kernel's order.

    For each token ``t < num_tokens`` (``q`` = ``fmt``'s fake quant, a BF16 row;
    ``add(v, s)`` is ``acc + v``, or ``fma(v, weights[t, s], acc)`` with one FP32 rounding
    when ``weights`` is given; with ``accumulate="fp32"``, ``q`` is the FP32 dequantized row,
    not rounded to BF16)::

        acc = +0.0 (FP32)
        acc += float(rows[k, t])              if shared_position == "first" (unquantized)
        for s in 0..k-1 ascending, if topk_idx[t, s] >= 0:
            acc = add(float(q(rows[s, t])), s)
        acc += float(rows[k, t])              if shared_position == "last"
        out[t] = bf16(acc)                    (one RNE rounding)

    Routed slot ``s`` is row ``s``; a fused shared row is row ``k`` wherever it is added
    (every build stores it there). Invalid rows are never read (stale NaN cannot leak).

    Optionally, in the same pass:

    - ``check_against`` (BF16 ``[T, H]``, the kernel's ``y``; may be ``out`` itself) and
      ``check_flag`` (int32 device tensor): the *unquantized* sum (weighted the same way),
      rounded to BF16, is compared bitwise with ``check_against`` over the tokens with a
      valid routed slot, or every token when a shared row is fused; the number of
      mismatching elements is **added** to ``check_flag[0]`` (zero it first; it stays 0
      when the layout is right).
    - ``calib_amax`` (FP32 device tensor): ``calib_amax[0] = max(calib_amax[0],
      max |rows|)`` over the valid routed rows, unweighted (atomic max; the shared row is
      excluded).

    Args:
        rows: BF16 ``[k (+1), Tmax, H]`` (a strided view into the buffer, H contiguous).
        topk_idx: int ``[>= T, k]``; ``-1`` marks an invalid slot.
        num_tokens: ``T``.
        out: BF16 ``[T, H]``, written in place.
        fmt: the format's row of ``moewire.format_table`` (``WireFormat.facts``), or the
            name of one, of :data:`SUPPORTED_FORMATS` (``bf16``: no quantization).
        amax: FP32 one-element device tensor for the formats that need one (``fp8``,
            ``nvfp4``, ``fp8_e4m3fnuz``: a static scale).
        shared_position: ``None``, ``"first"`` or ``"last"`` (:data:`SHARED_POSITIONS`).
        check_against, check_flag, calib_amax: see above.
        weights: ``None`` (rows already router-weighted), or FP32 ``[>= T, k]``, the staged
            ``topk_weights`` of a kernel that leaves unweighted rows (``nvfp4_mega_moe``).
        accumulate: ``"bf16"`` (each quantized row rounded to BF16 before it is added,
            ModelOpt's QDQ) or ``"fp32"`` (the FP32 dequantized values added as they are,
            as the real FP8/FP4 combine kernels do); :data:`ACCUMULATE_MODES`.
        block_h, num_warps, unroll: tuning only (``unroll``: unroll the slot loop; default
            :func:`~moewire.kernels.tuning.unroll`).

    Returns:
        ``out``.
    """
    row = _check_format(fmt)
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(
            f"moewire.kernels.fused_combine: accumulate must be one of {ACCUMULATE_MODES}, "
            f"got {accumulate!r}"
        )
    _check_kernel_args(
        rows, topk_idx, num_tokens, out, shared_position, check_against, check_flag,
        calib_amax, weights,
    )
    impl = _impl()
    hidden = rows.shape[2]
    _check_blocks("moewire.kernels.fused_combine: H", hidden, row)
    amax_t = _amax_tensor(row, amax, rows.device)
    if num_tokens == 0:
        return out
    bh = tuning.block_h(row, hidden, block_h)
    grid = (num_tokens, _triton_mod().cdiv(hidden, bh))
    check = check_against is not None
    dummy = out
    weighted = weights is not None
    impl.combine_kernel[grid](
        rows, topk_idx,
        weights if weighted else dummy,
        out,
        check_against if check else dummy,
        check_flag if check else dummy,
        calib_amax if calib_amax is not None else dummy,
        amax_t if amax_t is not None else dummy,
        hidden, rows.stride(0), rows.stride(1), topk_idx.stride(0), topk_idx.stride(1),
        weights.stride(0) if weights is not None else 0,
        weights.stride(1) if weights is not None else 0,
        out.stride(0), check_against.stride(0) if check_against is not None else 0,
        K=topk_idx.shape[1], SHARED=SHARED_POSITIONS.index(shared_position),
        FMT=row.kernel_code, SPLIT=row.split_tile, HAS_AMAX=amax_t is not None,
        WEIGHTED=weighted,
        CHECK=check, ACC_F32=accumulate == "fp32",
        CALIB=calib_amax is not None, BLOCK_H=bh, HW_CAST=rows.is_cuda,
        UNROLL=tuning.unroll(row, topk_idx.shape[1], check) if unroll is None else unroll,
        num_warps=tuning.num_warps(row, bh, num_warps), enable_fp_fusion=False,
    )
    return out
