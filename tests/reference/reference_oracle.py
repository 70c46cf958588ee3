"""Independent oracles for the reference kernel: numpy, float64 and ml_dtypes only.

Nothing here calls moewire's casts: FP4/FP8/UE8M0 values are decoded with ml_dtypes, the
MoE is a plain per-token loop in float64, and the combine re-sum is numpy float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16


def np_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor as uint8 numpy, last dim multiplied by the item size."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8).numpy()


def ue8m0_scales(packed: torch.Tensor) -> np.ndarray:
    """float64 scales ``[..., 4 * C]`` from int32 ``[..., C]`` (byte j of int i: group 4i+j)."""
    return np_bytes(packed).view(E8M0).astype(np.float64)


def fp8_values(q: torch.Tensor) -> np.ndarray:
    return np_bytes(q).view(E4M3).astype(np.float64)


def bf16_values(t: torch.Tensor) -> np.ndarray:
    return np_bytes(t).view(BF16).astype(np.float64)


def fp4_values(packed: torch.Tensor) -> np.ndarray:
    """float64 ``[..., 2 * C]`` from packed int8 ``[..., C]`` (element 2j in the low nibble)."""
    b = np_bytes(packed)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    return codes.astype(np.uint8).view(E2M1).astype(np.float64)


def dequantize(weight, per: int = 32) -> np.ndarray:
    """float64 ``[..., N, K]`` of an untransformed weight (pair or BF16 tensor)."""
    if not isinstance(weight, tuple):
        return bf16_values(weight)
    w, sf = weight
    values = fp8_values(w) if w.dtype == torch.float8_e4m3fn else fp4_values(w)
    scales = ue8m0_scales(sf)
    return values * np.repeat(scales, per, axis=-1)


def staged_tokens(buf, t: int) -> np.ndarray:
    """float64 ``[T, H]``: the tokens staged in the buffer, decoded."""
    if buf.mma_type == "bf16xbf16":
        return bf16_values(buf.x[:t])
    return fp8_values(buf.x[:t]) * np.repeat(ue8m0_scales(buf.x_sf[:t]), 32, axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _situ(gate, up, alpha, beta):
    """Kimi-K3's SiTU in float64 with np.tanh (the kernel: 2*sigmoid(2x)-1 in FP32)."""
    gated = alpha * np.tanh(gate / alpha) / (1.0 + np.exp(-gate))
    return gated * (beta * np.tanh(up / beta) if beta > 0 else up)


def _mlp(x, w1, w2, weight, clamp, rounding, situ=None):
    gu = x @ w1.T
    if rounding:
        gu = gu.astype(np.float32).astype(BF16).astype(np.float64)
    half = w1.shape[0] // 2
    gate, up = gu[..., :half], gu[..., half:]
    if clamp is not None:
        gate, up = np.minimum(gate, clamp), np.clip(up, -clamp, clamp)
    h = (silu(gate) * up if situ is None else _situ(gate, up, *situ)) * weight
    if rounding == "fp8":
        groups = h.reshape(*h.shape[:-1], -1, 32)
        amax = np.abs(groups).max(axis=-1, keepdims=True)
        sf = np.exp2(np.ceil(np.log2(np.maximum(amax, 2.0**-200) / 448.0)))
        h = ((groups / sf).astype(E4M3).astype(np.float64) * sf).reshape(h.shape)
    elif rounding == "bf16":
        h = h.astype(BF16).astype(np.float64)
    out = h @ w2.T
    if rounding:
        out = out.astype(np.float32).astype(BF16).astype(np.float64)
    return out


def dense_moe(
    x: np.ndarray,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    l1: np.ndarray,
    l2: np.ndarray,
    shared: tuple[np.ndarray, np.ndarray] | None = None,
    clamp: float | None = None,
    rounding: str | None = None,
    situ: tuple[float, float] | None = None,
) -> np.ndarray:
    """Plain MoE, one token at a time, float64 (``situ=(alpha, beta)``: SiTU, not SwiGLU).

    ``rounding=None``: no intermediate rounding at all (the "true" MoE on the staged
    tokens and dequantized weights). ``"fp8"`` / ``"bf16"``: round where the kernel rounds
    (L1 output to BF16, ``h`` to FP8 UE8M0 per 32 or BF16, rows to BF16), still summing in
    float64.
    """
    t = x.shape[0]
    y = np.zeros((t, l2.shape[1]), dtype=np.float64)
    for i in range(t):
        for s in range(topk_idx.shape[1]):
            e = int(topk_idx[i, s])
            if e >= 0:
                y[i] += _mlp(x[i], l1[e], l2[e], topk_weights[i, s], clamp, rounding, situ)
        if shared is not None:
            y[i] += _mlp(x[i], shared[0], shared[1], 1.0, clamp, rounding, situ)
    return y


def combine_base(buf) -> int:
    """Byte offset of the combine region by DeepGEMM's rule for the buffer's flavour: the
    buffer's tail where the region is last, else the end of the L2 scale region."""
    num_slots = buf.num_topk + (1 if buf.num_shared_experts else 0)
    size = num_slots * buf.num_max_tokens_per_rank * buf.hidden * 2
    if buf._moewire_flavour in ("vllm-0.33", "deepgemm-sm90"):
        view = buf.l2_acts_sf if buf.mma_type == "fp8xfp4" else buf.l2_acts
        return view.data_ptr() + view.numel() * view.element_size() - buf.buffer.data_ptr()
    return buf.buffer.numel() - size


def combine_rows(buf) -> np.ndarray:
    """float32 ``[num_slots, Tmax, H]`` rows read from the raw buffer bytes."""
    num_slots = buf.num_topk + (1 if buf.num_shared_experts else 0)
    tmax, h = buf.num_max_tokens_per_rank, buf.hidden
    base = combine_base(buf)
    raw = np_bytes(buf.buffer)[base : base + num_slots * tmax * h * 2]
    return raw.view(BF16).astype(np.float32).reshape(num_slots, tmax, h)


def resum(buf, topk_idx: np.ndarray, t: int) -> np.ndarray:
    """BF16 bits (uint16 ``[T, H]``) of the kernel's combine, redone in numpy float32.

    Valid routed slots in ascending order; a fused shared row (stored at slot ``k``) added
    first (``vllm-0.33``) or last (``vllm-0.32``); FP32 accumulator from +0.0, one BF16
    rounding at the end.
    """
    rows = combine_rows(buf)
    k = buf.num_topk
    shared = buf.num_shared_experts > 0
    first = shared and buf._moewire_flavour == "vllm-0.33"
    order = [("routed", s, s) for s in range(k)]
    if shared:
        entry = ("shared", None, k)
        order = [entry, *order] if first else [*order, entry]
    acc = np.zeros((t, buf.hidden), dtype=np.float32)
    for kind, s, pos in order:
        for i in range(t):
            if kind == "shared" or topk_idx[i, s] >= 0:
                acc[i] = acc[i] + rows[pos, i]
    return acc.astype(BF16).view(np.uint16)
