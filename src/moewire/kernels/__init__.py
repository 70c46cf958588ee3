"""Fast Triton kernels for moewire's row-local wire formats (GPU only).

Two entry points, each bit-exact to the torch definitions in ``moewire.formats`` and
``moewire.megamoe.resum`` (which give the same bits on CPU and CUDA):

- :func:`qdq`: fake quantization of ``[..., H]`` tensors (the dispatch quantizer);
- :func:`fused_combine`: the combine re-sum in one pass over the combine rows: each valid
  row is loaded once, fake-quantized in registers, accumulated in FP32 in ascending slot
  order (router-weighted with one FMA rounding for the NVFP4 kernel's unweighted rows)
  with the fused shared row in its place, rounded once to BF16 and written to ``out``; in
  the same pass, optionally, the layout check (the unquantized sum compared bitwise with
  the kernel's ``y``) and the calibration max over valid rows.

Both are CUDA-graph safe: no host synchronisation, and the grid depends only on shapes.
This package imports nothing from moewire's other packages: a format comes in as its name
and its amax as a plain FP32 device tensor.

``available()`` says whether the kernels can run here (CUDA and Triton importable, and the
environment variable ``MOEWIRE_DISABLE_KERNELS`` not set to ``1``). Under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the first import of Triton) the same
kernels also run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

__all__ = [
    "SHARED_POSITIONS",
    "SUPPORTED_FORMATS",
    "available",
    "check_combine_args",
    "fused_combine",
    "qdq",
    "supports",
]

SUPPORTED_FORMATS = (
    "bf16",
    "fp8",
    "fp8_b128",
    "fp8_b128_ue8m0",
    "fp8_b32_ue8m0",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "nvfp4_token",
)
# Where a fused shared row (stored at row ``k`` in every build) is added to the combine sum:
# not at all, before the routed slots, or after them. The one definition; ``megamoe``
# re-exports it.
SHARED_POSITIONS = (None, "first", "last")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Columns per program: a power of two holding whole blocks of every format; nvfp4_token
# takes the whole row (its global scale is the row's amax).
_BLOCK_H = 1024
# The slot loop unrolled (static_range) or rolled: see _unroll.
_UNROLLED = frozenset({"bf16", "mxfp8", "mxfp4"})
_UNROLLED_UP_TO_K8 = frozenset({"fp8", "fp8_b128", "fp8_b128_ue8m0", "fp8_b32_ue8m0"})
_UNROLLED_UNCHECKED_UP_TO_K8 = frozenset({"nvfp4"})


def _unroll(fmt_name: str, k: int, check: bool) -> bool:
    """Whether the combine kernel's slot loop is unrolled by default, from the tuning grid
    of ``benchmarks/kernel_variants.py`` on the H200 (T = 8192, each shape at its default
    program size; benchmarks/results/h200-v5/: ``variants_*`` with the check, ``nochk_*``
    without). Unrolling overlaps more rows, rolling needs fewer registers:

    - BF16, MXFP8, MXFP4 (:data:`_UNROLLED`): unrolled on every shape, or within 3%.
    - The FP8 formats (:data:`_UNROLLED_UP_TO_K8`): unrolled up to k = 8 (FP8 with the
      check 279 vs 296 us at 8 x 8192 x 7168), rolled at Kimi-K3's k = 16 (FP8 block 128
      with the check 311 vs 335 us; within 1% without it).
    - NVFP4 (:data:`_UNROLLED_UNCHECKED_UP_TO_K8`): with the check it holds the expected
      tile and the unchecked sum besides, and unrolled it needs 116+ registers a thread
      (8 programs an SM) where rolled takes 96 (10): rolled is faster (395 vs 425 us at
      8 x 8192 x 7168, 364 vs 452 at k = 16, within 1% at k = 6). Without the check it is
      unrolled up to k = 8 (366 vs 383 us; V4-Pro 266 vs 294) and rolled at k = 16 (372 vs
      423 us).
    - nvfp4_token: rolled (whole-row programs: registers, compile time).
    """
    if fmt_name in _UNROLLED_UNCHECKED_UP_TO_K8:
        return not check and k <= 8
    if fmt_name in _UNROLLED_UP_TO_K8:
        return k <= 8
    return fmt_name in _UNROLLED
# Formats whose program holds whole 16-element blocks per thread (the kernels' ``SPLIT``:
# the two halves of each block loaded apart and joined; see ``_triton._tile_cols``), so
# one thread per 16 columns.
_SPLIT = frozenset({"nvfp4", "nvfp4_token"})


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when the Triton kernels can run on CUDA tensors in this process.

    False without CUDA, without an importable Triton, or with ``MOEWIRE_DISABLE_KERNELS=1``
    (then every caller takes the torch reference path).
    """
    if os.environ.get("MOEWIRE_DISABLE_KERNELS", "0") == "1":
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def supports(fmt_name: str) -> bool:
    """True when a kernel exists for the wire format ``fmt_name`` (a registry name)."""
    return fmt_name in SUPPORTED_FORMATS


def _impl() -> ModuleType:
    try:
        from moewire.kernels import _triton
    except ImportError as exc:
        raise RuntimeError(
            "moewire.kernels: Triton is not importable here; install the GPU extra "
            "(pip install 'moewire[gpu]') or use the torch reference (formats.get(name).reference)"
        ) from exc
    return _triton


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.is_cuda or (_interpreting() and t.device.type == "cpu"):
        return
    raise RuntimeError(
        f"moewire.kernels: {what} is on {t.device}; the Triton kernels run on CUDA tensors "
        "(or on CPU under TRITON_INTERPRET=1); use the torch reference elsewhere"
    )


def _check_format(fmt_name: str) -> None:
    if not supports(fmt_name):
        raise ValueError(
            f"moewire.kernels: no kernel for wire format {fmt_name!r}; supported: "
            f"{', '.join(SUPPORTED_FORMATS)} (use formats.get(name).reference for the others)"
        )


def _amax_tensor(
    fmt_name: str, amax: torch.Tensor | float | None, device: torch.device
) -> torch.Tensor | None:
    """The FP32 ``[1]`` amax on ``device`` for ``fp8``/``nvfp4``, else ``None``."""
    if fmt_name not in _impl().NEEDS_AMAX:
        return None
    if amax is None:
        raise ValueError(
            f"moewire.kernels: format {fmt_name!r} needs an amax (its scale is global); pass "
            "the calibrated or constant FP32 amax tensor"
        )
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    if amax_t.numel() != 1:
        raise ValueError(
            f"moewire.kernels: amax must hold one element, got shape {tuple(amax_t.shape)}"
        )
    # A no-op for a device FP32 tensor; a host number is copied once (outside graphs).
    return amax_t.reshape(1).to(device)


def _check_blocks(what: str, hidden: int, fmt_name: str) -> None:
    """``hidden`` holds whole blocks of the format (the kernel's own block table)."""
    block = _impl().BLOCK_SIZES[fmt_name]
    if hidden % block:
        raise ValueError(
            f"{what}={hidden} is not a multiple of {fmt_name}'s block size {block}"
        )


def _num_warps(fmt_name: str, block_h: int, num_warps: int | None) -> int:
    """Warps per program: 8 columns per thread (at most 16 warps; a 128-column program
    gets one warp); the split formats (:data:`_SPLIT`) one 16-element block per thread."""
    if num_warps:
        return num_warps
    if fmt_name in _SPLIT:
        return max(1, min(16, block_h // 512))
    return max(1, min(16, block_h // 256))


def _block_h(fmt_name: str, hidden: int, block_h: int | None, *,
             pad_least: bool = True) -> int:
    """Columns per program: ``block_h`` if given; else the whole row (``nvfp4_token``, or a
    row shorter than 1024 columns); else 1024, or with ``pad_least`` (the combine) of 1024,
    512 and 256 the one that pads the row's last program least, the larger on a tie.

    The combine takes ``pad_least``: at H = 3584 (Kimi-K3) seven full 512-column programs
    beat four 1024-column ones whose last is half empty but still runs the slot loop. The
    dispatch QDQ (one pass, no loop) does not: there 512-column programs are 18% slower
    than 1024 at H = 3584 on the H200 (36.2 vs 30.5 us for FP8 at T = 8192, every format
    alike; ``benchmarks/results/h200-v5/qdq_block_grid.log``)."""
    whole_row = triton_next_pow2(hidden)
    if fmt_name == "nvfp4_token":
        return whole_row
    if block_h is not None:
        return min(block_h, whole_row)
    if whole_row <= _BLOCK_H or not pad_least:
        return min(whole_row, _BLOCK_H)
    return min((_BLOCK_H, _BLOCK_H // 2, _BLOCK_H // 4),
               key=lambda bh: (-hidden % bh, -bh))


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 128, the largest block of any format)."""
    return max(128, 1 << (max(n, 1) - 1).bit_length())


def qdq(
    x: torch.Tensor,
    fmt_name: str,
    amax: torch.Tensor | float | None,
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` in ``fmt_name``, bit-exact to ``formats.get(fmt_name).reference``.

    Args:
        x: BF16/FP16/FP32 ``[..., H]`` on CUDA; blocks run along the last dim (H a multiple
            of the format's block size: the caller, ``WireFormat.qdq``, validates that).
        fmt_name: one of :data:`SUPPORTED_FORMATS`.
        amax: FP32 one-element tensor (or number) for ``fp8`` and ``nvfp4``; ignored by
            the other formats.
        block_h: columns per program (a power of two >= 128); tuning only.
        num_warps: warps per program; tuning only.

    Returns:
        A new tensor, same shape and dtype as ``x``.
    """
    _check_format(fmt_name)
    _check_device(x, "x")
    if x.dtype not in _FLOAT_DTYPES or x.dim() == 0:
        raise ValueError(
            f"moewire.kernels.qdq: x must be a BF16/FP16/FP32 tensor with at least one dim, "
            f"got {x.dtype} {list(x.shape)}"
        )
    impl = _impl()
    hidden = x.shape[-1]
    _check_blocks("moewire.kernels.qdq: the last dim", hidden, fmt_name)
    amax_t = _amax_tensor(fmt_name, amax, x.device)
    flat = x.reshape(-1, hidden)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty_like(flat, memory_format=torch.contiguous_format)
    if flat.numel() == 0:
        return out.reshape(x.shape)
    bh = _block_h(fmt_name, hidden, block_h, pad_least=False)
    grid = (flat.shape[0], _triton_mod().cdiv(hidden, bh))
    impl.qdq_kernel[grid](
        flat, out, amax_t if amax_t is not None else flat, hidden, flat.stride(0), out.stride(0),
        FMT=impl.FORMAT_CODES[fmt_name], HAS_AMAX=amax_t is not None, BLOCK_H=bh,
        HW_CAST=x.is_cuda, num_warps=_num_warps(fmt_name, bh, num_warps),
        enable_fp_fusion=False,
    )
    return out.reshape(x.shape)


def _triton_mod() -> ModuleType:
    import triton

    return triton


def check_combine_args(
    where: str,
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    shared_position: str | None,
    out: torch.Tensor | None,
    weights: torch.Tensor | None = None,
) -> None:
    """Validate the arguments of a combine re-sum (shared by ``megamoe.resum`` and
    :func:`fused_combine`); ``where`` names the caller in the message. Device-agnostic:
    the kernel adds its own device and stride checks."""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bfloat16 or rows.dim() != 3:
        raise ValueError(
            f"{where}: rows must be a BF16 tensor [num_slots, Tmax, H] (the combine region "
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
        not isinstance(weights, torch.Tensor)
        or weights.dtype != torch.float32
        or weights.dim() != 2
        or weights.shape[1] != k
        or weights.shape[0] < num_tokens
        or weights.device != rows.device
    ):
        raise ValueError(
            f"{where}: weights must be the staged router weights, FP32 [>= {num_tokens}, {k}] "
            f"on {rows.device} (the buffer's topk_weights), got {_desc(weights)}"
        )
    if out is not None:
        want = (num_tokens, rows.shape[2])
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.bfloat16
            or tuple(out.shape) != want
            or out.device != rows.device
        ):
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
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.bfloat16
            or tuple(t.shape) != want
            or t.device != rows.device
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
        if t is not None and (
            not isinstance(t, torch.Tensor)
            or t.dtype != dtype
            or t.numel() < 1
            or t.device != rows.device
        ):
            raise ValueError(
                f"{where}: {name} must be a {dtype} device tensor (one element is used) on "
                f"{rows.device}, got {_desc(t)}"
            )


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__


def fused_combine(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor,
    fmt_name: str,
    amax: torch.Tensor | float | None,
    shared_position: str | None,
    check_against: torch.Tensor | None = None,
    check_flag: torch.Tensor | None = None,
    calib_amax: torch.Tensor | None = None,
    *,
    weights: torch.Tensor | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    unroll: bool | None = None,
) -> torch.Tensor:
    """Fake-quantize and re-sum the combine rows in one pass, the kernel's order.

    For each token ``t < num_tokens`` (``q`` = ``fmt_name``'s fake quant, a BF16 row;
    ``add(v, s)`` is ``acc + v``, or ``fma(v, weights[t, s], acc)`` with one FP32 rounding
    when ``weights`` is given)::

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
        fmt_name: one of :data:`SUPPORTED_FORMATS` (``bf16``: no quantization).
        amax: FP32 one-element device tensor for ``fp8`` and ``nvfp4`` (static scale).
        shared_position: ``None``, ``"first"`` or ``"last"`` (:data:`SHARED_POSITIONS`).
        check_against, check_flag, calib_amax: see above.
        weights: ``None`` (rows already router-weighted), or FP32 ``[>= T, k]``, the staged
            ``topk_weights`` of a kernel that leaves unweighted rows (``nvfp4_mega_moe``).
        block_h, num_warps, unroll: tuning only (``unroll``: unroll the slot loop; default
            :func:`_unroll`).

    Returns:
        ``out``.
    """
    _check_format(fmt_name)
    _check_kernel_args(
        rows, topk_idx, num_tokens, out, shared_position, check_against, check_flag,
        calib_amax, weights,
    )
    impl = _impl()
    hidden = rows.shape[2]
    _check_blocks("moewire.kernels.fused_combine: H", hidden, fmt_name)
    amax_t = _amax_tensor(fmt_name, amax, rows.device)
    if num_tokens == 0:
        return out
    bh = _block_h(fmt_name, hidden, block_h)
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
        weights.stride(0) if weighted else 0, weights.stride(1) if weighted else 0,
        out.stride(0), check_against.stride(0) if check else 0,
        K=topk_idx.shape[1], SHARED=impl.SHARED_CODES[shared_position],
        FMT=impl.FORMAT_CODES[fmt_name], HAS_AMAX=amax_t is not None, WEIGHTED=weighted,
        CHECK=check,
        CALIB=calib_amax is not None, BLOCK_H=bh, HW_CAST=rows.is_cuda,
        UNROLL=_unroll(fmt_name, topk_idx.shape[1], check) if unroll is None else unroll,
        num_warps=_num_warps(fmt_name, bh, num_warps), enable_fp_fusion=False,
    )
    return out
