"""Stand-in for DeepGEMM 2.8.0's NVFP4 x NVFP4 Mega-MoE (``deep_gemm.fp4_fp4_mega_moe``), CPU
and GPU.

The API of deepseek-ai/DeepGEMM 0274ad7 (2.8.0) ``deep_gemm/mega/__init__.py`` and
``csrc/apis/mega_moe.hpp``; the numerics of ``deep_gemm/include/deep_gemm/impls/
sm100_fp4_fp4_mega_moe.cuh`` at 794783a (PR #409; 0274ad7's own copy is not stored). What
differs from the other Mega-MoE kernels:

- Routed tokens and weights are NVFP4 (E2M1 with one E4M3 scale per 16, four scale bytes per
  int32), no per-token scale; per local expert ``l1_alphas`` (FP32 ``[E_local, 2]``: gate and
  up apart, ModelOpt's ``weight_scale_2`` of w1 and w3, with any input global scale folded
  in by the caller), ``l2_alphas`` (FP32 ``[E_local]``) and ``a2_scales`` (FP32 ``[E_local]``,
  the L2 input's global scale, ModelOpt's ``input_scale`` of w2).
- L1's accumulators are scaled by the alphas before the BF16 rounding, the SwiGLU output
  is **not** router-weighted, and it is requantized to NVFP4 with ``1 / a2_scale``
  (``fp4_fp4._numerics.requantize_l2_input``).
- L2: ``row = bf16(fl(float(bf16(fl(acc * fl(l2_alpha * a2_scale)))) * topk_weight))``: the
  router weight is applied after L2, before the row is written to the source rank's
  combine region.
- A fused shared expert is BF16 and reads the caller's ``x_bf16`` (not the staged tokens):
  ``gate, up = bf16(acc)`` (no alpha), ``h = bf16(silu(gate) * up)``, ``row = bf16(acc2)``,
  weight 1, stored at slot ``k``.
- The combine sums the valid routed rows in ascending slot order in FP32 from +0.0; then,
  with a shared expert or a ``routed_scaling_factor`` other than 1, the sum is rounded to
  BF16, multiplied by the factor (one more BF16 rounding; skipped for 1), and the shared
  row is added last in FP32; one final BF16 rounding gives ``y``.

Its buffer is ``fp4_fp4.buffer.FP4SymmBuffer`` (``get_symm_buffer_for_mega_moe(...,
mma_type="fp4xfp4")`` of the ``deepgemm-2.8`` flavour).

May import: torch, the reference modules below the ``deep_gemm`` API (``_numerics``,
``_weights_cache``, ``_kernel``), the NVFP4 family's ``nvfp4._numerics`` and ``nvfp4.mega_moe``
(its NVFP4 weight reader and its SwiGLU: the same math) and this family's ``_numerics`` and
``buffer``; ``deep_gemm`` re-exports it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from moewire.reference import _kernel, _weights_cache
from moewire.reference._numerics import decode_e2m1
from moewire.reference.fp4_fp4._numerics import requantize_l2_input
from moewire.reference.fp4_fp4.buffer import FP4SymmBuffer, _fail
from moewire.reference.nvfp4._numerics import (
    NVFP4_BLOCK,
    dequantize_nvfp4,
    pack_e4m3,
    pack_fp4_codes,
)
from moewire.reference.nvfp4.mega_moe import _activation, _NVFP4Experts, slot_sum

__all__ = ["combine", "fp4_fp4_mega_moe"]

KERNEL = "fp4_fp4_mega_moe"
RECIPE = (1, 1, 16)


# --------------------------------------------------------------------------- checks


def _check_weights(where: str, name: str, pair: Any, n: int, k: int, e: int, device) -> None:
    if not isinstance(pair, tuple) or len(pair) != 2:
        _fail(where, f"{name} must be a (weight, scale) tuple", TypeError)
    _kernel._check_tensor(where, f"{name}[0]", pair[0], (torch.int8, torch.uint8),
                          (e, n, k // 2), device)
    _kernel._check_tensor(where, f"{name}[1]", pair[1], torch.int32, (e, n, k // 64), device)


def _check_scale(where: str, name: str, t: Any, shape: tuple, device, positive: bool) -> None:
    if t is None:
        return
    _kernel._check_tensor(where, name, t, torch.float32, shape, device)
    capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
    if positive and not capturing and not bool((torch.isfinite(t) & (t > 0)).all()):
        _fail(where, f"every entry of {name} must be finite and > 0 (the kernel asserts it)")


def _validate(y, l1, l2, buf, shared_l1, shared_l2, x_bf16, stats, recipe, activation, clamp,
              fast_math, l1_alphas, l2_alphas, a2_scales, rsf) -> int:
    where = KERNEL
    if not isinstance(buf, FP4SymmBuffer):
        _fail(
            where,
            "NVFP4 MegaMoE requires an fp4xfp4 symmetric buffer, got "
            f"{type(buf).__name__} (mma_type={getattr(buf, 'mma_type', None)!r}); build it "
            "with get_symm_buffer_for_mega_moe(..., mma_type='fp4xfp4') under the "
            "deepgemm-2.8 flavour",
        )
    if buf.buffer is None:
        _fail(where, "sym_buffer was destroyed; allocate a new one")
    if activation != buf.activation:
        _fail(where, f"activation mismatch: buffer={buf.activation!r}, call={activation!r}")
    if tuple(recipe) != RECIPE:
        _fail(where, f"recipe must be {RECIPE} (NVFP4: one E4M3 scale per 16), got {recipe!r}")
    if (shared_l1 is None) != (shared_l2 is None) or (shared_l1 is None) != (x_bf16 is None):
        _fail(where, "shared_l1_weights, shared_l2_weights and x_bf16 must be given together")
    if clamp is not None and not (
        isinstance(clamp, (int, float)) and not isinstance(clamp, bool) and clamp >= 0
    ):
        _fail(where, f"activation_clamp must be a float >= 0 or None, got {clamp!r}")
    if not isinstance(fast_math, bool):
        _fail(where, f"fast_math must be a bool, got {fast_math!r}", TypeError)
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not math.isfinite(rsf):
        _fail(where, f"routed_scaling_factor must be a finite float, got {rsf!r}")
    device = buf.buffer.device
    h, i, e = buf.hidden, buf.intermediate_hidden, buf.num_experts_per_rank
    t = _kernel._check_y(where, y, buf)
    _check_weights(where, "l1_weights", l1, 2 * i, h, e, device)
    _check_weights(where, "l2_weights", l2, h, i, e, device)
    _check_scale(where, "l1_alphas", l1_alphas, (e, 2), device, positive=False)
    _check_scale(where, "l2_alphas", l2_alphas, (e,), device, positive=False)
    _check_scale(where, "a2_scales", a2_scales, (e,), device, positive=True)
    if stats is not None:
        _kernel._check_tensor(where, "cumulative_local_expert_recv_stats", stats, torch.int32,
                              (e,), device)
    count = 0 if shared_l2 is None else (
        shared_l2.shape[1] // i if isinstance(shared_l2, torch.Tensor) and shared_l2.dim() == 2
        else -1
    )
    if count != buf.num_shared_experts:
        _fail(
            where,
            f"shared-expert layout mismatch: buffer={buf.num_shared_experts}, call={count}; "
            "build the buffer with num_shared_experts equal to the shared weights' width / I",
        )
    if shared_l1 is not None:
        shared_i = buf.num_shared_experts * i
        _kernel._check_tensor(where, "shared_l1_weights", shared_l1, torch.bfloat16,
                              (2 * shared_i, h), device)
        _kernel._check_tensor(where, "shared_l2_weights", shared_l2, torch.bfloat16,
                              (h, shared_i), device)
        if not isinstance(x_bf16, torch.Tensor) or x_bf16.dtype != torch.bfloat16 or (
            x_bf16.dim() != 2 or x_bf16.shape[0] < t or x_bf16.shape[1] != h
        ) or x_bf16.device != device:
            _fail(where, f"x_bf16 must be BF16 [>= {t}, {h}] on {device} (the local tokens the "
                         "shared expert reads)")
    return t


# --------------------------------------------------------------------------- math


def _expert_rows(
    x_packed: torch.Tensor,
    x_sf: torch.Tensor,
    expert: torch.Tensor,
    ends: torch.Tensor,
    weight: torch.Tensor,
    l1: _NVFP4Experts,
    l2: _NVFP4Experts,
    scales: dict,
    clamp: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine rows of received rows grouped by local expert (``expert``, any value past the
    last group for rows that are not computed).

    Returns:
        ``(rows, h_packed, h_sf)``: BF16 ``[N, H]`` (router-weighted), uint8 ``[N, I/2]``,
        int32 ``[N, I/64]``.
    """
    n = x_packed.shape[0]
    e = expert.clamp(max=l1.weights[0].shape[0] - 1)
    ones = torch.ones(n, dtype=torch.float32, device=x_packed.device)
    acc1 = _kernel._grouped_matmul(dequantize_nvfp4(x_packed, x_sf), l1, ends, torch.float32)
    inter = acc1.shape[1] // 2
    a1 = scales["l1"]
    gate = acc1[:, :inter] * (a1[e, 0:1] if a1 is not None else ones.unsqueeze(1))
    up = acc1[:, inter:] * (a1[e, 1:2] if a1 is not None else ones.unsqueeze(1))
    h = _activation(torch.cat([gate, up], dim=1).bfloat16(), clamp, 1.0, 0.0, "swiglu")
    a2 = scales["a2"][e] if scales["a2"] is not None else None
    codes, h_sf = requantize_l2_input(h, a2)
    h_in = (decode_e2m1(codes).unflatten(-1, (-1, NVFP4_BLOCK)) * h_sf.unsqueeze(-1)).flatten(-2)
    acc2 = _kernel._grouped_matmul(h_in, l2, ends, torch.float32)
    l2_alpha = scales["l2"][e] if scales["l2"] is not None else ones
    l2_scale = l2_alpha * a2 if a2 is not None else l2_alpha
    rows = (acc2 * l2_scale.unsqueeze(1)).bfloat16().float() * weight.unsqueeze(1)
    return rows.bfloat16(), pack_fp4_codes(codes).view(torch.uint8), pack_e4m3(h_sf)


def _stage_received(buf: FP4SymmBuffer, xq, xs, h_q, h_sf, weight) -> None:
    """Write the received rows' views (the real ring holds them in pool order)."""
    n = xq.shape[0]
    buf.l1_acts[:n].copy_(xq.view(torch.uint8))
    buf.l1_acts_sf[:n].copy_(xs)
    buf.l2_acts[:n].copy_(h_q)
    buf.l2_acts_sf[:n].copy_(h_sf)
    buf.region("routed_topk_weights").view(torch.float32)[:n].copy_(weight)


def _routed_one_rank(buf, t, l1, l2, scales, clamp, region) -> torch.Tensor:
    """All routed rows of a one-rank buffer with static shapes and no host sync (CUDA-graph
    capturable): every (token, slot) pair in expert order, invalid ones under a sentinel
    expert sorted last, their combine rows written back unchanged. Returns int32 rows per
    local expert."""
    e_local, k, tmax, h = buf.num_experts_per_rank, buf.num_topk, buf.num_max_tokens_per_rank, \
        buf.hidden
    device = buf.buffer.device
    idx = buf.topk_idx[:t]
    flat = torch.where(idx >= 0, idx, e_local).flatten()
    order = torch.argsort(flat, stable=True)
    token, slot, expert = order // k, order % k, flat[order]
    ends = torch.searchsorted(expert, torch.arange(e_local, device=device), right=True).to(
        torch.int32)
    xq, xs = buf.x[:t][token], buf.x_sf[:t][token]
    weight = buf.topk_weights[:t].flatten()[order]
    rows, h_q, h_sf = _expert_rows(xq, xs, expert, ends, weight, l1, l2, scales, clamp)
    _stage_received(buf, xq, xs, h_q, h_sf, weight)
    flat_region = region.view(-1, h)
    dest = slot * tmax + token
    keep = (expert < e_local).unsqueeze(1)
    flat_region.index_copy_(0, dest, torch.where(keep, rows, flat_region[dest]))
    return torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int32, device=device))


def _routed_expert_parallel(buf, t, l1, l2, scales, clamp, region) -> torch.Tensor:
    """All-to-all of (packed row, scales, router weight, local expert) to the owning ranks,
    the expert MLPs there, and the rows back into the source rank's combine region."""
    e_local = buf.num_experts_per_rank
    token, slot, expert, dest = _kernel.valid_slots_by_rank(buf.topk_idx[:t], e_local)
    fields = [
        _kernel._bytes(buf.x[:t][token]),
        _kernel._bytes(buf.x_sf[:t][token]),
        _kernel._bytes(buf.topk_weights[:t][token, slot].unsqueeze(1)),
        _kernel._bytes((expert - dest * e_local).to(torch.int32).unsqueeze(1)),
    ]
    widths = [f.shape[1] for f in fields]
    send_counts = torch.bincount(dest, minlength=buf.num_ranks).tolist()
    received, recv_counts = _kernel._all_to_all(torch.cat(fields, dim=1), send_counts, buf)
    x_packed, x_sf, weight, local = torch.split(received, widths, dim=1)
    local = local.contiguous().view(torch.int32).squeeze(1).long()
    by_expert = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=e_local)[:e_local]
    ends = torch.cumsum(counts, 0).to(torch.int32)
    xq = x_packed[by_expert].contiguous()
    xs = x_sf[by_expert].contiguous().view(torch.int32)
    w = weight[by_expert].contiguous().view(torch.float32).squeeze(1)
    rows, h_q, h_sf = _expert_rows(xq, xs, local[by_expert], ends, w, l1, l2, scales, clamp)
    _stage_received(buf, xq, xs, h_q, h_sf, w)
    back = torch.empty_like(rows)
    back[by_expert] = rows
    back_bytes, _ = _kernel._all_to_all(_kernel._bytes(back), recv_counts, buf)
    dest_rows = slot * buf.num_max_tokens_per_rank + token
    region.view(-1, buf.hidden).index_copy_(0, dest_rows, back_bytes.view(torch.bfloat16))
    return counts


def _shared_rows(buf: FP4SymmBuffer, t: int, shared_l1, shared_l2, x_bf16, clamp) -> torch.Tensor:
    """The fused BF16 shared expert on the caller's ``x_bf16[:T]``: BF16 ``[T, H]`` rows."""
    h, shared_i = buf.hidden, buf.num_shared_experts * buf.intermediate_hidden
    s1 = _weights_cache.Experts(shared_l1, True, 1, 2 * shared_i, h)
    s2 = _weights_cache.Experts(shared_l2, False, 1, h, shared_i)
    ends = torch.full((1,), t, dtype=torch.int32, device=buf.buffer.device)
    gu = _kernel._grouped_matmul(x_bf16[:t].float(), s1, ends, torch.float32).bfloat16()
    act = _activation(gu, clamp, 1.0, 0.0, "swiglu").bfloat16()
    buf.shared_l2_acts[:t].copy_(act)
    return _kernel._grouped_matmul(act.float(), s2, ends, torch.float32).bfloat16()


def combine(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    num_tokens: int,
    shared: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """The kernel's combine (``impls/sm100_fp4_fp4_mega_moe.cuh``, "Combine: reduce top-k").

    Per token, ``acc = +0.0`` (FP32) plus each valid routed row (``topk_idx >= 0``) in
    ascending slot order (``__ffs`` of the slot mask). With a shared row (slot ``k``, the
    highest bit, so the last loaded) or a factor ``s = fl(routed_scaling_factor) != 1``:
    ``r = bf16(acc)``, ``r = bf16(fl(r * s))`` when ``s != 1``, ``acc = float(r) (+ shared
    row)``; then ``y = bf16(acc)``. Invalid slots are selected away (their rows are stale).

    Args:
        rows: BF16 ``[k (+1), >= T, H]``.
        topk_idx: int ``[T, k]``.
        num_tokens: ``T``.
        shared: slot ``k`` holds a fused shared expert's row.
        routed_scaling_factor: the factor of the routed sum.

    Returns:
        BF16 ``[T, H]``.
    """
    t, k = num_tokens, topk_idx.shape[1]
    acc = slot_sum(rows, topk_idx, t, lambda acc, row, s: acc + row)
    # The kernel takes the factor as a C float: its FP32 value (a Python float holding it
    # multiplies an FP32 tensor exactly as that FP32 scalar).
    scale = float(torch.tensor(float(routed_scaling_factor), dtype=torch.float32))
    if shared or scale != 1.0:
        routed = acc.bfloat16()
        if scale != 1.0:
            routed = (routed.float() * scale).bfloat16()
        acc = routed.float()
        if shared:
            acc = acc + rows[k, :t].float()
    return acc.bfloat16()


# --------------------------------------------------------------------------- kernel


def fp4_fp4_mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    sym_buffer: FP4SymmBuffer,
    shared_l1_weights: torch.Tensor | None = None,
    shared_l2_weights: torch.Tensor | None = None,
    x_bf16: torch.Tensor | None = None,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    recipe: tuple[int, int, int] = RECIPE,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    l1_alphas: torch.Tensor | None = None,
    l2_alphas: torch.Tensor | None = None,
    a2_scales: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> None:
    """The fused NVFP4 x NVFP4 Mega-MoE: dispatch, L1, SwiGLU, requant, L2, combine; writes
    ``y``.

    Reads the ``T = y.shape[0]`` staged tokens of ``sym_buffer``. For every valid slot of
    every token, on the rank owning expert ``e`` (``a1 = l1_alphas[e]``, ``a2 =
    a2_scales[e]``, ``a = l2_alphas[e]``; a missing scale is 1):

    1. ``x = e2m1 * e4m3`` (exact); ``gate = bf16(fl(acc_gate * a1[0]))``, ``up =
       bf16(fl(acc_up * a1[1]))`` from the FP32 accumulators of ``x @ W1[e].T``.
    2. ``gate = min(gate, c)``, ``up = clamp(up, -c, c)`` (BF16, with ``activation_clamp =
       c``); ``h = fl(fl(g / fl(1 + exp(-g))) * up)``, FP32, unweighted.
    3. ``h`` to NVFP4 with ``1 / a2`` (``fp4_fp4._numerics.requantize_l2_input``).
    4. ``row = bf16(fl(float(bf16(fl(acc2 * fl(a * a2)))) * w))`` with ``w`` the token's
       router weight for the slot, written to the source rank's combine region at (slot,
       token). Rows of invalid slots are not written.

    A fused shared expert runs on ``x_bf16[:T]`` into slot ``k``. Then ``y`` is the combine
    of :func:`combine`. ``DG_COMM_KERNEL_DEBUG=1`` zeroes the buffer afterwards.

    Args:
        y: BF16 ``[T, H]``, contiguous, written in place.
        l1_weights: ``(int8/uint8 [E_local, 2I, H/2], int32 [E_local, 2I, H/64])``: E2M1 pairs
            and four E4M3 scales per int32, transformed by ``transform_weights_for_mega_moe``
            (gate/up interleaved by 8, scale rows in UTCCP order); any strides.
        l2_weights: ``(int8/uint8 [E_local, H, I/2], int32 [E_local, H, I/64])``, transformed.
        sym_buffer: the ``fp4xfp4`` buffer (:class:`~moewire.reference.fp4_fp4.buffer.
            FP4SymmBuffer`).
        shared_l1_weights, shared_l2_weights: BF16 ``[2Is, H]`` (transformed) and
            ``[H, Is]``, with ``x_bf16``: BF16 ``[>= T, H]``; all three or none.
        cumulative_local_expert_recv_stats: optional int32 ``[E_local]``.
        recipe: ``(1, 1, 16)``. activation: ``"swiglu"``. activation_clamp: ``c`` or None.
        fast_math: accepted (the stand-in divides and exponentiates exactly).
        l1_alphas: FP32 ``[E_local, 2]``; l2_alphas, a2_scales: FP32 ``[E_local]``; or None.
        routed_scaling_factor: the factor of the routed sum (finite).
    """
    t = _validate(
        y, l1_weights, l2_weights, sym_buffer, shared_l1_weights, shared_l2_weights, x_bf16,
        cumulative_local_expert_recv_stats, recipe, activation, activation_clamp, fast_math,
        l1_alphas, l2_alphas, a2_scales, routed_scaling_factor,
    )
    buf = sym_buffer
    e_local, h, i, k = buf.num_experts_per_rank, buf.hidden, buf.intermediate_hidden, buf.num_topk
    topk_idx = buf.topk_idx[:t]
    bad = (topk_idx < -1) | (topk_idx >= buf.num_experts)
    if y.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(~bad.any())  # no host sync inside a CUDA graph
    elif bool(bad.any()):
        _fail(KERNEL, f"sym_buffer.topk_idx[:{t}] holds expert ids outside [-1, "
                      f"{buf.num_experts}); stage valid ids (padding slots get -1)")
    region = buf.combine_rows()
    l1 = _NVFP4Experts(l1_weights, True, e_local, 2 * i, h)
    l2 = _NVFP4Experts(l2_weights, False, e_local, h, i)
    scales = {"l1": l1_alphas, "l2": l2_alphas, "a2": a2_scales}
    routed = _routed_one_rank if buf.num_ranks == 1 else _routed_expert_parallel
    counts = routed(buf, t, l1, l2, scales, activation_clamp, region)
    if cumulative_local_expert_recv_stats is not None:
        cumulative_local_expert_recv_stats += counts.to(torch.int32)
    buf.workspace[:e_local].copy_(counts.to(torch.int32))
    shared = shared_l1_weights is not None
    if shared and t:
        region[k, :t].copy_(_shared_rows(buf, t, shared_l1_weights, shared_l2_weights, x_bf16,
                                         activation_clamp))
    y.copy_(combine(region, topk_idx, t, shared, routed_scaling_factor))
    if os.environ.get("DG_COMM_KERNEL_DEBUG", "0").strip() not in ("", "0"):
        buf.buffer.zero_()
