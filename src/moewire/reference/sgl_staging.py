"""Stand-in of sgl-deep-gemm's SM90 staging function ``mega_moe_pre_dispatch_sm90`` (CPU and GPU).

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

May import: torch.
"""

from __future__ import annotations

import torch

__all__ = ["E4M3_MAX", "GROUP_SIZE", "mega_moe_pre_dispatch_sm90"]

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
