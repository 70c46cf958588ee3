"""Stand-in for DeepGEMM's NVFP4 Mega-MoE (``deep_gemm.nvfp4_mega_moe``), CPU and GPU.

The second Mega-MoE kernel of the DeepGEMM bundled in vLLM 0.33 and 0.34
(``vllm/third_party/deep_gemm/mega/nvfp4.py``, identical in both wheels), used by NVFP4
checkpoints through ``DeepGemmMegaMoEExperts`` (``MEGA_MOE_NVFP4``, ``uses_nvfp4_api``).
Same names and signatures: :class:`NVFP4SymmBuffer`, :func:`nvfp4_mega_moe`,
:func:`get_block_m_for_nvfp4_mega_moe`, :func:`get_token_alignment_for_nvfp4_mega_moe`, and
vLLM's staging function :func:`prepare_megamoe_nvfp4_inputs`
(``model_executor/layers/fused_moe/prepare_megamoe.py``), in torch.

Where it differs from ``fp8_fp4_mega_moe`` (vLLM 0.34.0's bundled `impls/sm100_nvfp4_mega_moe.cuh`):

- Routed inputs are NVFP4 on the wire: E2M1, one E4M3 scale per 16, optional per-token
  FP32 ``x_scales``; weights are NVFP4 too, with a per-expert FP32 ``l1_alpha`` /
  ``l2_alpha`` applied to the GEMM accumulators before the BF16 rounding.
- The L2 input is **not** router-weighted: a combine row is the unweighted expert output.
- The combine is ``acc = fma(float(row), w_slot, acc)`` in FP32 over the valid slots in
  ascending order, a fused shared expert (stored at slot ``k``) last with weight 1.0, then
  one BF16 rounding (``impls/sm100_nvfp4_mega_moe.cuh`` ~l.1746-1807).
- Its own buffer layout (``include/deep_gemm/layout/nvfp4_mega_moe.cuh``): the combine region
  starts where the L2 scale region (``l2_acts_sf``) ends, and the per-token ``x_scales``
  regions **follow** it, so the combine region is not the buffer's last region.

Its buffer is in the family's ``buffer`` and vLLM's staging in its ``staging``; the names
above are re-exported here.

May import: torch, the reference modules below the ``deep_gemm`` API
(``moewire.reference._numerics``, ``_weights_cache``, ``_kernel``) and the family's
``_numerics``, ``buffer`` and ``staging``; ``deep_gemm`` re-exports it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from moewire.reference import _kernel, _weights_cache
from moewire.reference._numerics import (
    decode_e2m1,
    pack_ue8m0,
    scale_groups,
    unpack_ue8m0,
)
from moewire.reference.nvfp4._numerics import (
    dequantize_nvfp4,
    fma_f32,
    pack_e4m3,
    pack_fp4_codes,
    quantize_mxfp8_l2_input,
    quantize_nvfp4_l2_input,
)
from moewire.reference.nvfp4.buffer import (
    NVFP4SymmBuffer,
    _fail,
    get_block_m_for_nvfp4_mega_moe,
    get_token_alignment_for_nvfp4_mega_moe,
    shared_sf_row,
)
from moewire.reference.nvfp4.staging import prepare_megamoe_nvfp4_inputs

__all__ = [
    "NVFP4SymmBuffer",
    "get_block_m_for_nvfp4_mega_moe",
    "get_token_alignment_for_nvfp4_mega_moe",
    "nvfp4_mega_moe",
    "prepare_megamoe_nvfp4_inputs",
    "shared_sf_row",
    "weighted_combine",
]

ACTIVATIONS = ("swiglu", "swiglustep")


# --------------------------------------------------------------------------- weights


class _NVFP4Experts:
    """Routed NVFP4 weights handing out dense ``[N, K]`` (the interface of
    ``_weights_cache.Experts``): E2M1 times E4M3, exact in FP32 and in BF16."""

    def __init__(self, weights: tuple, is_l1: bool, num_experts: int, n: int, k: int) -> None:
        self.weights = weights
        self.is_l1 = is_l1
        self.n = n
        device = weights[0].device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dense = _weights_cache.WEIGHT_CACHE.get(
            tuple(weights),
            lambda: self._dequantize(0, num_experts).to(self.dtype),
            num_experts * n * k * self.dtype.itemsize,
            device,
        )

    def _dequantize(self, first: int, last: int) -> torch.Tensor:
        w, sf = self.weights[0][first:last], self.weights[1][first:last]
        dense = dequantize_nvfp4(w, _weights_cache._untranspose_sf(sf.contiguous()))
        return _weights_cache._uninterleave_gate_up(dense) if self.is_l1 else dense

    def __getitem__(self, e: int) -> torch.Tensor:
        if self.dense is not None:
            return self.dense[e].float()
        return self._dequantize(e, e + 1)[0]


# --------------------------------------------------------------------------- math


def _activation(
    gu: torch.Tensor, clamp: float | None, alpha: float, beta: float, activation: str
) -> torch.Tensor:
    """The L1 epilogue on BF16 ``[N, 2I]`` (``[gate | up]``): FP32 ``h`` ``[N, I]``.

    ``swiglu``: ``gate = min(gate, c)``, ``up = clamp(up, -c, c)`` in BF16 (``c`` rounded
    to BF16, as ``__hmin2`` takes it), ``h = gate * sigmoid(alpha * gate) * (up + beta)``
    with ``sigmoid`` written as ``gate / (1 + exp(-alpha * gate))`` (exact ``expf`` and
    division: the kernel's ``fast_math`` uses ``__expf`` and an approximate reciprocal).
    ``swiglustep``: the gate is not clamped before; ``silu(gate)`` is clamped above by ``c``
    (FP32) after.
    """
    gate, up = gu.chunk(2, dim=-1)
    if clamp is not None:
        # c rounded to BF16 once, then used as a Python scalar: exact in BF16, so the BF16
        # clamp equals __hmin2's, and no host tensor meets a CUDA one (CUDA-graph safe).
        c16 = float(torch.tensor(float(clamp)).bfloat16())
        if activation == "swiglu":
            gate = torch.clamp(gate, max=c16)
        up = torch.clamp(up, min=-c16, max=c16)
    gate, up = gate.float(), up.float()
    sigmoid_input = gate * alpha if alpha != 1.0 else gate
    gated = gate / (1.0 + torch.exp(-sigmoid_input))
    if activation == "swiglustep" and clamp is not None:
        gated = torch.clamp(gated, max=float(clamp))
    if beta != 0.0:
        up = up + beta
    return gated * up


def _routed_rows(
    x_packed: torch.Tensor,
    x_sf: torch.Tensor,
    x_scale: torch.Tensor | None,
    local_expert: torch.Tensor,
    ends: torch.Tensor,
    l1: _NVFP4Experts,
    l2: _NVFP4Experts,
    l1_alpha: torch.Tensor | None,
    l2_alpha: torch.Tensor | None,
    opts: dict,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed expert rows for received rows grouped by local expert.

    ``gu = bf16(fl(acc1 * fl(x_scale * l1_alpha[e])))`` (``x_scale`` only with
    ``use_x_scales``), the activation, the NVFP4 cast of the unweighted ``h``
    (:func:`quantize_nvfp4_l2_input`), ``row = bf16(fl(acc2 * l2_alpha[e]))``.

    Returns:
        ``(rows, h_packed, h_sf)``: BF16 ``[N, H]``, int8 ``[N, I/2]``, int32 ``[N, I/64]``.
    """
    ones = torch.ones(x_packed.shape[0], dtype=torch.float32, device=x_packed.device)
    e = local_expert
    scale1 = l1_alpha[e] if l1_alpha is not None else ones
    if x_scale is not None:
        scale1 = x_scale * scale1
    x_in = dequantize_nvfp4(x_packed, x_sf)
    gu = (_kernel._grouped_matmul(x_in, l1, ends, torch.float32) * scale1.unsqueeze(1)).bfloat16()
    h = _activation(gu, opts["clamp"], opts["alpha"], opts["beta"], opts["activation"])
    codes, h_bs = quantize_nvfp4_l2_input(h, opts["l2_activation_scale"])
    h_in = (decode_e2m1(codes).unflatten(-1, (-1, 16)) * h_bs.unsqueeze(-1)).flatten(-2)
    scale2 = l2_alpha[e] if l2_alpha is not None else ones
    rows = (_kernel._grouped_matmul(h_in, l2, ends, torch.float32) * scale2.unsqueeze(1)).bfloat16()
    return rows, pack_fp4_codes(codes), pack_e4m3(h_bs)


def _shared_rows(buf: NVFP4SymmBuffer, t: int, shared_l1: Any, shared_l2: Any, opts: dict):
    """The fused shared expert on this rank's ``T`` tokens: BF16 ``[T, H]`` rows.

    Input ``shared_l1_acts[:T]`` (MXFP8 with its scales at :func:`shared_sf_row`, or BF16),
    alpha 1, no ``x_scales``; ``h`` re-cast to E4M3 with UE8M0 per 32 (DeepGEMM's
    ``get_ue8m0_sf_exp``) or rounded to BF16; weight 1.
    """
    device = buf.buffer.device
    h, shared_i = buf.hidden, buf.num_shared_experts * buf.intermediate_hidden
    x = buf.shared_l1_acts[:t].float()
    if buf.shared_with_sf:
        block_m = get_block_m_for_nvfp4_mega_moe(
            buf.num_ranks, buf.num_experts, buf.num_max_tokens_per_rank, t, buf.num_topk
        )
        rows = shared_sf_row(torch.arange(t, device=device), block_m)
        x = scale_groups(x, unpack_ue8m0(buf.shared_l1_acts_sf[rows]))
    s1 = _weights_cache.Experts(shared_l1, True, 1, 2 * shared_i, h)
    s2 = _weights_cache.Experts(shared_l2, False, 1, h, shared_i)
    ends = torch.full((1,), t, dtype=torch.int32, device=device)
    gu = _kernel._grouped_matmul(x, s1, ends, torch.float32).bfloat16()
    act = _activation(gu, opts["clamp"], opts["alpha"], opts["beta"], opts["activation"])
    if buf.shared_with_sf:
        q, sf = quantize_mxfp8_l2_input(act)
        buf.shared_l2_acts[:t].copy_(q)
        buf.shared_l2_acts_sf[:t].copy_(pack_ue8m0(sf))
        act_in = scale_groups(q.float(), sf)
    else:
        act_in = act.bfloat16()
        buf.shared_l2_acts[:t].copy_(act_in)
        act_in = act_in.float()
    return _kernel._grouped_matmul(act_in, s2, ends, torch.float32).bfloat16()


# --------------------------------------------------------------------------- checks


def _check_pair(where, name, pair, dtypes, shape, sf_shape, device) -> None:
    if not isinstance(pair, tuple) or len(pair) != 2:
        _fail(where, f"{name} must be a (weight, scale) tuple", TypeError)
    _kernel._check_tensor(where, f"{name}[0]", pair[0], dtypes, shape, device)
    _kernel._check_tensor(where, f"{name}[1]", pair[1], torch.int32, sf_shape, device)


def _validate(y, l1, l2, buf, shared_l1, shared_l2, stats, clamp, fast_math, alpha, beta,
              l1_alpha, l2_alpha, l2_scale, use_x_scales, activation) -> int:
    where = "nvfp4_mega_moe"
    if not isinstance(buf, NVFP4SymmBuffer):
        _fail(
            where,
            f"sym_buffer must be an NVFP4SymmBuffer, got {type(buf).__name__} (NVFP4 requires "
            "NVFP4SymmBuffer; fp8_fp4_mega_moe takes get_symm_buffer_for_mega_moe's)",
            TypeError,
        )
    if buf.buffer is None:
        _fail(where, "sym_buffer was destroyed; allocate a new one")
    if activation not in ACTIVATIONS:
        _fail(where, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("activation_alpha", alpha), ("activation_beta", beta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value
        ):
            _fail(where, f"{name} must be a finite float, got {value!r}")
    if activation == "swiglustep" and (alpha != 1.0 or beta != 0.0 or buf.num_shared_experts):
        _fail(
            where,
            "swiglustep takes activation_alpha=1, activation_beta=0 and routed experts only "
            "(no fused shared expert)",
        )
    if clamp is not None and not (
        isinstance(clamp, (int, float)) and not isinstance(clamp, bool) and clamp > 0
    ):
        _fail(where, f"activation_clamp must be a positive float or None, got {clamp!r}")
    if not isinstance(fast_math, bool):
        _fail(where, f"fast_math must be a bool, got {fast_math!r}", TypeError)
    if not isinstance(use_x_scales, bool):
        _fail(where, f"use_x_scales must be a bool, got {use_x_scales!r}", TypeError)
    if isinstance(l2_scale, bool) or not isinstance(l2_scale, (int, float)) or not (
        0 < l2_scale < float("inf")
    ):
        _fail(where, f"l2_activation_scale must be a positive finite float, got {l2_scale!r}")
    device = buf.buffer.device
    h, i, e = buf.hidden, buf.intermediate_hidden, buf.num_experts_per_rank
    t = _kernel._check_y(where, y, buf)
    fp4 = (torch.int8, torch.uint8)
    _check_pair(where, "l1_weights", l1, fp4, (e, 2 * i, h // 2), (e, 2 * i, h // 64), device)
    _check_pair(where, "l2_weights", l2, fp4, (e, h, i // 2), (e, h, i // 64), device)
    for name, alpha_t in (("l1_alpha", l1_alpha), ("l2_alpha", l2_alpha)):
        if alpha_t is not None:
            _kernel._check_tensor(where, name, alpha_t, torch.float32, (e,), device)
    if stats is not None:
        _kernel._check_tensor(
            where, "cumulative_local_expert_recv_stats", stats, torch.int32, (e,), device
        )
    _kernel._check_shared_given(where, buf, shared_l1, shared_l2)
    if shared_l1 is not None:
        shared_i = buf.num_shared_experts * i
        if buf.shared_with_sf:
            fp8 = (torch.float8_e4m3fn,)
            _check_pair(where, "shared_l1_weights", shared_l1, fp8, (2 * shared_i, h),
                        (2 * shared_i, h // 128), device)
            _check_pair(where, "shared_l2_weights", shared_l2, fp8, (h, shared_i),
                        (h, shared_i // 128), device)
        else:
            for name, w, shape in (("shared_l1_weights", shared_l1, (2 * shared_i, h)),
                                   ("shared_l2_weights", shared_l2, (h, shared_i))):
                _kernel._check_tensor(where, name, w, torch.bfloat16, shape, device)
    return t


def _as_bf16_shared(w: Any) -> Any:
    """DeepGEMM accepts a BF16 shared weight as ``(tensor, None)`` too."""
    if isinstance(w, tuple) and len(w) == 2 and w[1] is None:
        return w[0]
    return w


# --------------------------------------------------------------------------- kernel


def nvfp4_mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    sym_buffer: NVFP4SymmBuffer,
    shared_l1_weights: Any = None,
    shared_l2_weights: Any = None,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    activation_clamp: float | None = None,
    fast_math: bool = True,
    activation_alpha: float = 1.0,
    activation_beta: float = 0.0,
    l1_alpha: torch.Tensor | None = None,
    l2_alpha: torch.Tensor | None = None,
    l2_activation_scale: float = 1.0,
    use_x_scales: bool = False,
    activation: str = "swiglu",
) -> None:
    """The fused NVFP4 Mega-MoE: dispatch, L1, SwiGLU, L2, weighted combine; writes ``y``.

    Reads the ``T = y.shape[0]`` staged tokens of ``sym_buffer``. For every valid slot
    (``topk_idx >= 0``) of every token, on the rank owning expert ``e``:

    1. ``x = e2m1 * e4m3`` (exact); ``gu = bf16(fl(acc * fl(x_scale * l1_alpha[e])))`` with
       ``acc`` the FP32 accumulator of ``x @ W1[e].T`` (``x_scale`` only with
       ``use_x_scales``; a missing alpha is 1).
    2. The activation (see ``_activation``); the router weight is **not** applied.
    3. ``h`` cast to NVFP4 with ``l2_activation_scale``
       (:func:`~moewire.reference.nvfp4._numerics.quantize_nvfp4_l2_input`).
    4. ``row = bf16(fl(acc2 * l2_alpha[e]))``, written to the source rank's combine region
       at (slot, token). Rows of invalid slots are not written.

    A fused shared expert runs on this rank's tokens (``shared_l1_acts``) into slot ``k``.
    Then ``y[t] = bf16(acc)`` with ``acc = +0.0``, ``acc = fma(float(row_s), w[t, s], acc)``
    over the valid slots in ascending order, and the shared row last
    (``fma(row, 1.0, acc)``, an FP32 add). ``DG_COMM_KERNEL_DEBUG=1`` zeroes the buffer.

    Args:
        y: BF16 ``[T, H]``, written in place.
        l1_weights: ``(int8 [E_local, 2I, H/2], int32 [E_local, 2I, H/64])``: E2M1 packed
            two per byte and E4M3 scales per 16 packed four per int32, transformed by
            ``transform_weights_for_mega_moe`` (gate/up interleaved by 8, scale rows in
            UTCCP order); any strides (vLLM's scales are MN-major).
        l2_weights: ``(int8 [E_local, H, I/2], int32 [E_local, H, I/64])``, transformed.
        sym_buffer: an :class:`NVFP4SymmBuffer`.
        shared_l1_weights, shared_l2_weights: with ``shared_dtype`` FP8: ``(FP8 [2Is, H],
            int32 [2Is, H/128])`` and ``(FP8 [H, Is], int32 [H, Is/128])`` (UE8M0 per 32);
            with BF16: BF16 ``[2Is, H]`` and ``[H, Is]`` (or ``(tensor, None)``).
        cumulative_local_expert_recv_stats: optional int32 ``[E_local]``, incremented by the
            rows each local expert received.
        activation_clamp: ``c`` or None. fast_math: accepted (the stand-in is exact).
        activation_alpha, activation_beta: ``gate * sigmoid(alpha * gate) * (up + beta)``.
        l1_alpha, l2_alpha: FP32 ``[E_local]`` or None (1).
        l2_activation_scale: the routed L2 input's global scale (include it in l2_alpha).
        use_x_scales: multiply the L1 accumulator by the token's ``x_scales`` entry.
        activation: ``"swiglu"`` or ``"swiglustep"``.
    """
    shared_l1_weights = _as_bf16_shared(shared_l1_weights)
    shared_l2_weights = _as_bf16_shared(shared_l2_weights)
    t = _validate(
        y, l1_weights, l2_weights, sym_buffer, shared_l1_weights, shared_l2_weights,
        cumulative_local_expert_recv_stats, activation_clamp, fast_math, activation_alpha,
        activation_beta, l1_alpha, l2_alpha, l2_activation_scale, use_x_scales, activation,
    )
    buf = sym_buffer
    e_local, h, i, k = buf.num_experts_per_rank, buf.hidden, buf.intermediate_hidden, buf.num_topk
    topk_idx = buf.topk_idx[:t]
    bad = (topk_idx < -1) | (topk_idx >= buf.num_experts)
    if bool(bad.any()):
        _fail(
            "nvfp4_mega_moe",
            f"sym_buffer.topk_idx[:{t}] holds expert ids outside [-1, {buf.num_experts}); "
            "stage valid ids (padding slots get -1)",
        )
    opts = {
        "clamp": activation_clamp, "alpha": float(activation_alpha),
        "beta": float(activation_beta), "activation": activation,
        "l2_activation_scale": float(l2_activation_scale),
    }
    region = buf.combine_rows()
    l1 = _NVFP4Experts(l1_weights, True, e_local, 2 * i, h)
    l2 = _NVFP4Experts(l2_weights, False, e_local, h, i)
    args = (buf, t, l1, l2, l1_alpha, l2_alpha, use_x_scales, opts, region)
    counts = _routed_one_rank(*args) if buf.num_ranks == 1 else _routed_expert_parallel(*args)
    if cumulative_local_expert_recv_stats is not None:
        cumulative_local_expert_recv_stats += counts.to(torch.int32)
    buf.workspace[:e_local].copy_(counts.to(torch.int32))
    if shared_l1_weights is not None and t:
        region[k, :t].copy_(_shared_rows(buf, t, shared_l1_weights, shared_l2_weights, opts))

    y.copy_(weighted_combine(region, topk_idx, buf.topk_weights[:t], t,
                             shared=shared_l1_weights is not None))
    if os.environ.get("DG_COMM_KERNEL_DEBUG", "0").strip() not in ("", "0"):
        buf.buffer.zero_()


def slot_sum(rows: torch.Tensor, topk_idx: torch.Tensor, num_tokens: int,
             add: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """The routed part of the SM100 kernels' combine: per token ``acc = +0.0`` (FP32), then
    for each valid slot ``s`` (``topk_idx >= 0``) in ascending order (``__ffs`` of the slot
    mask) ``acc = add(acc, float(rows[s, t]), s)``, the kernel's own arithmetic. Invalid
    slots are selected away, never multiplied by a mask: their rows are stale and may hold
    NaN.

    Args:
        rows: BF16 ``[k (+1), >= T, H]``; topk_idx: int ``[T, k]``; num_tokens: ``T``.
        add: ``(acc FP32 [T, H], row FP32 [T, H], slot) -> acc``.

    Returns:
        FP32 ``[T, H]``.
    """
    t, k = num_tokens, topk_idx.shape[1]
    valid = topk_idx[:t] >= 0
    acc = torch.zeros((t, rows.shape[2]), dtype=torch.float32, device=rows.device)
    for s in range(k):
        acc = torch.where(valid[:, s : s + 1], add(acc, rows[s, :t].float(), s), acc)
    return acc


def weighted_combine(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_tokens: int,
    shared: bool,
) -> torch.Tensor:
    """The NVFP4 kernel's combine (``impls/sm100_nvfp4_mega_moe.cuh`` ~l.1746-1807).

    Per token, ``acc = +0.0`` (FP32); for each valid slot ``s`` (``topk_idx >= 0``) in
    ascending order ``acc = fma(float(rows[s, t]), topk_weights[t, s], acc)`` (``__ffma2_rn``:
    one rounding); the shared row (slot ``k``) last with weight 1.0, which is the FP32 add
    ``acc + row``; then one BF16 rounding (RNE). Invalid slots are selected away, never
    multiplied by a mask: their rows are stale and may hold NaN.

    Args:
        rows: BF16 ``[k (+1), >= T, H]``.
        topk_idx: int ``[T, k]``; topk_weights: FP32 ``[T, k]``.
        num_tokens: ``T``.
        shared: whether slot ``k`` holds a fused shared expert's row.

    Returns:
        BF16 ``[T, H]``.
    """
    t, k = num_tokens, topk_idx.shape[1]
    weights = topk_weights[:t].float()
    acc = slot_sum(rows, topk_idx, t, lambda acc, row, s: fma_f32(row, weights[:, s : s + 1], acc))
    if shared:
        acc = acc + rows[k, :t].float()
    return acc.bfloat16()


def _run_experts(buf, x_packed, x_sf, x_scale, local, l1, l2, l1_alpha, l2_alpha, opts):
    """Sort received rows by local expert, run them, stage the buffer's views; rows in the
    received order and the per-expert counts."""
    n = x_packed.shape[0]
    by_expert = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=buf.num_experts_per_rank)[
        : buf.num_experts_per_rank
    ]
    ends = torch.cumsum(counts, 0).to(torch.int32)
    xq, xs = x_packed[by_expert], x_sf[by_expert]
    scale = x_scale[by_expert] if x_scale is not None else None
    rows, h_q, h_sf = _routed_rows(xq, xs, scale, local[by_expert], ends, l1, l2, l1_alpha,
                                   l2_alpha, opts)
    buf.l1_acts[:n].copy_(xq.view(torch.int8))
    buf.l1_acts_sf[:n].copy_(xs)
    buf.l2_acts[:n].copy_(h_q)
    buf.l2_acts_sf[:n].copy_(h_sf)
    if x_scale is not None:
        buf.region("l1_x_scales").view(torch.float32)[:n].copy_(scale)
    back = torch.empty_like(rows)
    back[by_expert] = rows
    return back, counts


def _routed_one_rank(buf, t, l1, l2, l1_alpha, l2_alpha, use_x_scales, opts, region):
    token, slot = torch.nonzero(buf.topk_idx[:t] >= 0, as_tuple=True)
    local = buf.topk_idx[:t][token, slot]
    scale = buf.x_scales[:t][token] if use_x_scales else None
    rows, counts = _run_experts(
        buf, buf.x[:t][token], buf.x_sf[:t][token], scale, local, l1, l2, l1_alpha, l2_alpha,
        opts,
    )
    region.view(-1, buf.hidden).index_copy_(0, slot * buf.num_max_tokens_per_rank + token, rows)
    return counts


def _routed_expert_parallel(buf, t, l1, l2, l1_alpha, l2_alpha, use_x_scales, opts, region):
    """All-to-all of (packed row, scales, x_scale, local expert) to the owning ranks, the
    expert MLPs there, and the rows back into the source rank's combine region."""
    e_local = buf.num_experts_per_rank
    token, slot, expert, dest = _kernel.valid_slots_by_rank(buf.topk_idx[:t], e_local)
    fields = [
        _kernel._bytes(buf.x[:t][token]),
        _kernel._bytes(buf.x_sf[:t][token]),
        _kernel._bytes(buf.x_scales[:t][token].unsqueeze(1)),
        _kernel._bytes((expert - dest * e_local).to(torch.int32).unsqueeze(1)),
    ]
    widths = [f.shape[1] for f in fields]
    send_counts = torch.bincount(dest, minlength=buf.num_ranks).tolist()
    received, recv_counts = _kernel._all_to_all(torch.cat(fields, dim=1), send_counts, buf)
    x_packed, x_sf, x_scale, local = torch.split(received, widths, dim=1)
    x_scale = x_scale.contiguous().view(torch.float32).squeeze(1)
    rows, counts = _run_experts(
        buf,
        x_packed.contiguous().view(torch.int8),
        x_sf.contiguous().view(torch.int32),
        x_scale if use_x_scales else None,
        local.contiguous().view(torch.int32).squeeze(1).long(),
        l1, l2, l1_alpha, l2_alpha, opts,
    )
    back, _ = _kernel._all_to_all(_kernel._bytes(rows), recv_counts, buf)
    dest_rows = slot * buf.num_max_tokens_per_rank + token
    region.view(-1, buf.hidden).index_copy_(0, dest_rows, back.view(torch.bfloat16))
    return counts
