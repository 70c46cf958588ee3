"""Stand-ins of sgl-deep-gemm's staging functions (CPU and GPU).

:func:`mega_moe_pre_dispatch_sm90` is the SM90 one; :func:`mega_moe_pre_dispatch` the
SM100 one and :func:`sglang_mega_moe_pre_dispatch` SGLang's own SM100 fp8xfp4 cast (their
own sections below).

Written from ``include/deep_gemm/impls/sm90_mega_moe_pre_dispatch.cuh`` of the sgl-deep-gemm
0.2.3.post2 and 0.2.5 wheels (the file is the same in both; the Python wrapper is
``deep_gemm/mega/__init__.py``). SGLang 0.5.23's ``run_sm90_mega_routed``
(``sglang/srt/layers/moe/mega_moe_sm90.py``) calls it as
``mega_moe_pre_dispatch_sm90(hidden_states, topk_ids, topk_weights, buf.x, buf.x_sf,
buf.topk_idx, buf.topk_weights, num_tokens=, group_size=128, routed_scaling_factor=)``.

For each token ``t < num_tokens`` and each group ``g`` of 128 columns of ``x`` (BF16
``[T, H]``), in FP32 (one kernel thread per 8 columns, a max-reduce over the 16 threads of
a group):

- ``absmax = max(max |x[t, g]|, 1e-10)``, ``sf = absmax / 448`` (FP32 division),
  ``inv = 1 / sf`` (FP32 division);
- ``buf_x[t, g] = e4m3_satfinite_rne(x[t, g] * inv)`` (the FP32 product, then
  ``__nv_cvt_float2_to_fp8x2(..., __NV_SATFINITE, __NV_E4M3)``);
- ``buf_x_sf[t, g] = sf`` (FP32, no power-of-two rounding);
- ``buf_topk_idx[t] = int64(topk_idx[t])``,
  ``buf_topk_weights[t] = topk_weights[t] * routed_scaling_factor`` (FP32 product).

Rows ``num_tokens <= t < padded_max`` of ``buf_topk_idx`` / ``buf_topk_weights`` become
``-1`` / ``0.0`` (padding: no valid slot), where ``padded_max`` is the buffer's row count;
``buf_x`` and ``buf_x_sf`` of those rows are left as they were.

May import: torch and ``moewire.reference._numerics``.
"""

from __future__ import annotations

import torch

from moewire.reference._numerics import ceil_exponent

__all__ = [
    "E4M3_MAX",
    "GROUP_SIZE",
    "mega_moe_pre_dispatch",
    "mega_moe_pre_dispatch_sm90",
    "sglang_mega_moe_pre_dispatch",
]

GROUP_SIZE = 128
E4M3_MAX = 448.0
_MIN_AMAX = 1e-10


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(
            f"mega_moe_pre_dispatch_sm90: {name} must be {dtype} {list(shape)}, got "
            f"{t.dtype} {list(t.shape)}"
        )


def mega_moe_pre_dispatch_sm90(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buf_x: torch.Tensor,
    buf_x_sf: torch.Tensor,
    buf_topk_idx: torch.Tensor,
    buf_topk_weights: torch.Tensor,
    num_tokens: int,
    group_size: int = GROUP_SIZE,
    routed_scaling_factor: float = 1.0,
) -> None:
    """Stage ``num_tokens`` tokens into the SM90 buffer views, in place (module docstring).

    Args:
        x: BF16 ``[>= num_tokens, H]``, ``H`` a multiple of 128.
        topk_idx: int32 ``[>= num_tokens, k]``; topk_weights: FP32 ``[>= num_tokens, k]``.
        buf_x: FP8 E4M3 ``[Tmax, H]``; buf_x_sf: FP32 ``[Tmax, H/128]``.
        buf_topk_idx: int64 ``[Tmax, k]``; buf_topk_weights: FP32 ``[Tmax, k]``.
        num_tokens: tokens to stage, ``<= Tmax``.
        group_size: 128 (the kernel's ``static_assert``).
        routed_scaling_factor: folded into the staged weights.

    Raises:
        ValueError: another group size, or a tensor of the wrong dtype or shape.
    """
    if group_size != GROUP_SIZE:
        raise ValueError(
            f"mega_moe_pre_dispatch_sm90: group_size must be {GROUP_SIZE} (the kernel's "
            f"static_assert), got {group_size}"
        )
    tmax, h = buf_x.shape
    k = buf_topk_idx.shape[1]
    if h % GROUP_SIZE or not 0 <= num_tokens <= tmax:
        raise ValueError(
            f"mega_moe_pre_dispatch_sm90: hidden {h} must be a multiple of {GROUP_SIZE} and "
            f"0 <= num_tokens={num_tokens} <= {tmax}"
        )
    _check("x", x[:num_tokens], torch.bfloat16, (num_tokens, h))
    _check("topk_idx", topk_idx[:num_tokens], torch.int32, (num_tokens, k))
    _check("topk_weights", topk_weights[:num_tokens], torch.float32, (num_tokens, k))
    _check("buf_x", buf_x, torch.float8_e4m3fn, (tmax, h))
    _check("buf_x_sf", buf_x_sf, torch.float32, (tmax, h // GROUP_SIZE))
    _check("buf_topk_idx", buf_topk_idx, torch.int64, (tmax, k))
    _check("buf_topk_weights", buf_topk_weights, torch.float32, (tmax, k))
    t = num_tokens
    groups = x[:t].float().view(t, h // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1).clamp_min(_MIN_AMAX)
    # Tensor by tensor: torch may turn a division by a Python scalar into a multiplication
    # by its rounded reciprocal (CUDA does), which is not the kernel's FP32 division.
    sf = amax / torch.full_like(amax, E4M3_MAX)
    inv = torch.ones_like(sf) / sf
    scaled = (groups * inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    buf_x[:t] = scaled.view(t, h).to(torch.float8_e4m3fn)
    buf_x_sf[:t] = sf
    buf_topk_idx[:t] = topk_idx[:t].to(torch.int64)
    # An FP32 product: torch multiplies an FP32 tensor by a Python float in FP32, with the
    # float rounded to FP32 as the kernel's float argument is (no host-to-device copy, so
    # this stages inside a CUDA-graph capture too).
    buf_topk_weights[:t] = topk_weights[:t] * float(routed_scaling_factor)
    buf_topk_idx[t:] = -1
    buf_topk_weights[t:] = 0.0


# -- SM100: mega_moe_pre_dispatch -------------------------------------------------------------
#
# Written from include/deep_gemm/impls/sm100_mega_moe_pre_dispatch.cuh of the sgl-deep-gemm
# 0.2.5 wheel (the Python wrapper: deep_gemm/mega/__init__.py, ``mega_moe_pre_dispatch(x,
# topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens,
# group_size=32, mma_type='fp8xfp4', buf_x_scales=None, expert_scales=None)``). SGLang
# 0.5.23 calls it for nvfp4xnvfp4 (group 16, ``buf_x_scales``) and mxf4xmxf4 (group 32).
# Per token ``t < num_tokens`` and group ``g`` of ``group_size`` columns, in FP32:
#
# - fp8xfp4 / mxf4xmxf4 (UE8M0): ``absmax = max(max |x[t, g]|, 1e-4)``, ``raw = absmax /
#   m`` (``m`` = 448 for E4M3, 6 for E2M1), ``e`` = the UE8M0 byte of the smallest power of
#   two >= raw (the FP32 exponent field, +1 if the mantissa is non-zero, clamped to
#   [1, 254]), ``inv = 2^(127 - e)``; the code of ``x * inv``: E4M3 saturating RNE, or E2M1
#   by the kernel's midpoint thresholds (ties to the even code, |v| clamped to 6, -0 -> 0);
#   the scale byte is ``e``.
# - nvfp4xnvfp4 (group 16): ``pts = max(row absmax, 1e-4) / 2688`` (448 x 6), ``sf =
#   e4m3_satfinite_rn(group absmax / (6 * pts))``, ``inv = 1 / (float(sf) * pts)`` (0 when
#   ``sf`` is 0); E2M1 codes of ``x * inv``; the scale byte is ``sf``'s E4M3 bits and
#   ``buf_x_scales[t] = pts``.
#
# FP4 codes are packed two per byte, the even column in the low nibble. Scale bytes go to
# ``buf_x_sf`` viewed as bytes at ``t * num_groups + g``. ``buf_topk_idx[t] =
# int64(topk_idx[t])``; ``buf_topk_weights[t] = topk_weights[t] * expert_scales[id]`` for a
# valid id when ``expert_scales`` is given (FP32), else the weights; rows ``num_tokens <= t``
# of both become ``-1`` / ``0.0``.

_MMA = {"fp8xfp4": (448.0, 8), "mxf4xmxf4": (6.0, 4), "nvfp4xnvfp4": (6.0, 4)}
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                    (3.5, True), (5.0, False))


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """The kernel's ``pre_dispatch_e2m1_encode``: 4-bit codes (uint8) of FP32 ``v``."""
    ax = v.abs().clamp(max=6.0)
    idx = torch.zeros_like(v, dtype=torch.uint8)
    for bound, inclusive in _E2M1_THRESHOLDS:
        idx += (ax >= bound if inclusive else ax > bound).to(torch.uint8)
    negative = (v < 0) & (idx != 0)
    return idx | (negative.to(torch.uint8) << 3)


def _ue8m0_byte(raw: torch.Tensor) -> torch.Tensor:
    """``pre_dispatch_cast_to_ue8m0``: the exponent byte of the smallest power of two >= raw."""
    return ceil_exponent(raw).clamp(1, 254)


def mega_moe_pre_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buf_x: torch.Tensor,
    buf_x_sf: torch.Tensor,
    buf_topk_idx: torch.Tensor,
    buf_topk_weights: torch.Tensor,
    num_tokens: int,
    group_size: int = 32,
    mma_type: str = "fp8xfp4",
    buf_x_scales: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
) -> None:
    """Stage ``num_tokens`` tokens into the SM100 buffer views, in place (section above).

    Args:
        x: BF16 ``[>= num_tokens, H]``.
        topk_idx: int32 ``[>= num_tokens, k]``; topk_weights: FP32 ``[>= num_tokens, k]``.
        buf_x: ``[Tmax, H]`` FP8 E4M3 (fp8xfp4) or ``[Tmax, H/2]`` one-byte packed E2M1.
        buf_x_sf: int32 ``[Tmax, H/group_size/4]`` (four scale bytes each).
        buf_topk_idx: int64 ``[Tmax, k]``; buf_topk_weights: FP32 ``[Tmax, k]``.
        num_tokens: tokens to stage.
        group_size: 32, 64 or 128 (UE8M0 kinds), 16 (nvfp4xnvfp4).
        mma_type: ``"fp8xfp4"``, ``"mxf4xmxf4"`` or ``"nvfp4xnvfp4"``.
        buf_x_scales: FP32 ``[Tmax]``, the per-token scale (nvfp4xnvfp4 only).
        expert_scales: FP32 ``[E]`` folded into the weights, or ``None``.

    Raises:
        ValueError: an unknown ``mma_type``, a group size the kernel does not instantiate
            for it, or a view of the wrong size.
    """
    where = "mega_moe_pre_dispatch"
    if mma_type not in _MMA:
        raise ValueError(f"{where}: unknown mma_type {mma_type!r}; known: {sorted(_MMA)}")
    nvfp4 = mma_type == "nvfp4xnvfp4"
    if (nvfp4 and group_size != 16) or (not nvfp4 and group_size not in (32, 64, 128)):
        raise ValueError(
            f"{where}: group_size {group_size} is not instantiated for {mma_type} (16 for "
            "nvfp4xnvfp4; 32, 64 or 128 for the UE8M0 kinds)"
        )
    if nvfp4 and buf_x_scales is None:
        raise ValueError(f"{where}: nvfp4xnvfp4 writes a per-token scale: pass buf_x_scales")
    finfo, bits = _MMA[mma_type]
    t, h = num_tokens, x.shape[1]
    tmax, k = buf_topk_idx.shape
    groups = h // group_size
    if h % (group_size * 4) or buf_x_sf.numel() * 4 != tmax * groups or not 0 <= t <= tmax:
        raise ValueError(
            f"{where}: hidden {h} must be a multiple of 4 x group_size ({group_size}), buf_x_sf "
            f"must hold {tmax} x {groups} bytes and 0 <= num_tokens={t} <= {tmax}"
        )
    if buf_x.numel() * buf_x.element_size() != tmax * h * bits // 8:
        raise ValueError(f"{where}: buf_x must hold {tmax} x {h * bits // 8} bytes")
    g = x[:t].float().view(t, groups, group_size)
    gmax = g.abs().amax(dim=-1)
    if nvfp4:
        row = gmax.amax(dim=-1, keepdim=True).clamp_min(1e-4)
        pts = row / torch.full_like(row, 448.0 * 6.0)
        sf = (gmax / (torch.full_like(pts, 6.0) * pts)).clamp(-E4M3_MAX, E4M3_MAX).to(
            torch.float8_e4m3fn)
        dec = sf.float() * pts
        inv = torch.where(sf.float() > 0, torch.ones_like(dec) / dec, torch.zeros_like(dec))
        sf_bytes = sf.view(torch.uint8)
        buf_x_scales[:t] = pts.view(t)
    else:
        raw = gmax.clamp_min(1e-4) / torch.full_like(gmax, finfo)
        exp = _ue8m0_byte(raw)
        inv = ((254 - exp) << 23).view(torch.float32)
        sf_bytes = exp.to(torch.uint8)
    scaled = (g * inv[..., None]).view(t, h)
    if bits == 8:
        buf_x.view(torch.float8_e4m3fn).view(tmax, h)[:t] = scaled.clamp(
            -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    else:
        codes = _e2m1_codes(scaled).view(t, h // 2, 2)
        buf_x.view(torch.uint8).view(tmax, h // 2)[:t] = codes[..., 0] | (codes[..., 1] << 4)
    buf_x_sf.view(torch.uint8).view(tmax, groups)[:t] = sf_bytes
    ids = topk_idx[:t].to(torch.int64)
    weights = topk_weights[:t].float()
    if expert_scales is not None:
        scale = expert_scales.float()[ids.clamp_min(0)]
        weights = torch.where(ids >= 0, weights * scale, weights)
    buf_topk_idx[:t] = ids
    buf_topk_weights[:t] = weights
    buf_topk_idx[t:] = -1
    buf_topk_weights[t:] = 0.0


# -- SGLang's own SM100 fp8xfp4 cast ----------------------------------------------------------
#
# ``sglang.kernels.ops.moe.dsv4.mega_moe_pre_dispatch(x, topk_idx, topk_weights, buf_x,
# buf_x_sf, buf_topk_idx, buf_topk_weights, quant_group_size=32, *, shared_x_sf=None,
# shared_block_m=0, copy_topk=True)``, written from the sglang 0.5.23 wheel's
# ``sglang/kernels/jit/csrc/deepseek_v4/mega_moe_pre_dispatch.cuh`` and
# ``include/sgl_kernel/deepseek_v4/fp8_utils.cuh`` (the CUDA path). For the ``T =
# x.shape[0]`` tokens and each group of ``quant_group_size`` columns: ``absmax = max(max |x|,
# 1e-10)``, ``e`` = the exponent field of ``absmax / 448`` (FP32) plus 1 if its mantissa is
# non-zero (no clamp), ``buf_x = e4m3_rn(clip(x * 2^(127 - e), +-448))``, the scale byte
# ``e`` at ``t * row_stride_bytes + g`` of ``buf_x_sf``; with ``copy_topk`` the ids and
# weights are copied as they are (int32 -> int64); rows ``T <= t`` of ``buf_topk_idx`` /
# ``buf_topk_weights`` become ``-1`` / ``0.0``.


def sglang_mega_moe_pre_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buf_x: torch.Tensor,
    buf_x_sf: torch.Tensor,
    buf_topk_idx: torch.Tensor,
    buf_topk_weights: torch.Tensor,
    quant_group_size: int = 32,
    *,
    shared_x_sf: torch.Tensor | None = None,
    shared_block_m: int = 0,
    copy_topk: bool = True,
) -> None:
    """Stage ``x.shape[0]`` tokens as SGLang's fp8xfp4 cast does (section above).

    Args:
        x: BF16 ``[T, H]``; topk_idx: int32 ``[T, k]``; topk_weights: FP32 ``[T, k]``.
        buf_x: FP8 E4M3 ``[Tmax, H]``; buf_x_sf: int32 ``[Tmax, H/quant_group_size/4]``.
        buf_topk_idx: int64 ``[Tmax, k]``; buf_topk_weights: FP32 ``[Tmax, k]``.
        quant_group_size: 32, 64 or 128.
        shared_x_sf, shared_block_m: the fused shared expert's paged copy of the scales
            (not modelled: refused).
        copy_topk: copy the routing (``False``: Mega-Gate staged it in the buffer).

    Raises:
        ValueError: another group size, a ``shared_x_sf``, or a view of the wrong size.
    """
    where = "sglang.kernels.ops.moe.dsv4.mega_moe_pre_dispatch (stand-in)"
    if quant_group_size not in (32, 64, 128):
        raise ValueError(f"{where}: quant_group_size must be 32, 64 or 128, got {quant_group_size}")
    if shared_x_sf is not None:
        raise ValueError(
            f"{where}: the fused shared expert's paged scale copy (shared_x_sf) is not "
            "modelled; build the layer with the shared expert unfused"
        )
    t, h = x.shape
    tmax, k = buf_topk_idx.shape
    groups = h // quant_group_size
    if h % (quant_group_size * 4) or tuple(buf_x.shape) != (tmax, h) or t > tmax or (
        buf_x_sf.shape[0] != tmax or buf_x_sf.shape[1] * 4 != groups
    ):
        raise ValueError(
            f"{where}: x [{t}, {h}] does not fit buf_x {list(buf_x.shape)} / buf_x_sf "
            f"{list(buf_x_sf.shape)} (hidden a multiple of 4 x {quant_group_size})"
        )
    g = x.float().view(t, groups, quant_group_size)
    amax = g.abs().amax(dim=-1).clamp_min(1e-10)
    raw = amax / torch.full_like(amax, E4M3_MAX)
    exp = ceil_exponent(raw)
    inv = ((254 - exp) << 23).view(torch.float32)
    scaled = (g * inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(t, h)
    buf_x.view(torch.float8_e4m3fn)[:t] = scaled.to(torch.float8_e4m3fn)
    # Byte t * row_stride + g: the uint8 view keeps the int32 rows' stride.
    buf_x_sf.view(torch.uint8)[:t, :groups] = exp.to(torch.uint8)
    if copy_topk:
        buf_topk_idx[:t] = topk_idx.to(torch.int64)
        buf_topk_weights[:t] = topk_weights
    buf_topk_idx[t:] = -1
    buf_topk_weights[t:] = 0.0

