"""Independent oracles for the stand-in NVFP4 kernel: numpy, float64, ml_dtypes, fractions.

Nothing here calls moewire's casts. Values are decoded with ml_dtypes; the staging cast is
redone in numpy float32; the MoE is a per-token float64 loop; the combine re-sum uses exact
rational arithmetic, rounded once to FP32 per fused multiply-add.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
from reference_oracle import BF16, E2M1, E4M3, bf16_values, fp4_values, np_bytes

F32 = np.float32


def e4m3_scales(packed: torch.Tensor) -> np.ndarray:
    """float64 ``[..., 4C]`` from int32 ``[..., C]`` (byte j of int i: 16-block 4i+j)."""
    return np_bytes(packed).view(E4M3).astype(np.float64)


def nvfp4_values(packed: torch.Tensor, sf: torch.Tensor) -> np.ndarray:
    """float64 ``[..., K]``: E2M1 element times its E4M3 block scale."""
    return fp4_values(packed) * np.repeat(e4m3_scales(sf), 16, axis=-1)


def staged_tokens(buf, t: int) -> np.ndarray:
    """float64 ``[T, H]`` of the staged routed tokens, ``x_scales`` included."""
    x_scales = buf.x_scales[:t].numpy().astype(np.float64)
    return nvfp4_values(buf.x[:t], buf.x_sf[:t]) * x_scales[:, None]


def stage(hidden: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's NVFP4 staging redone in numpy float32 + ml_dtypes.

    Returns:
        ``(x bytes uint8 [T, H/2], x_sf bytes uint8 [T, H/16], x_scales float32 [T])``.
    """
    h = hidden.float().numpy().astype(F32)
    if h.shape[0] == 0:
        return np.zeros((0, h.shape[1] // 2), np.uint8), np.zeros((0, h.shape[1] // 16),
                                                                  np.uint8), np.zeros(0, F32)
    amax = np.abs(h).max(axis=1)
    x_scale = np.maximum(amax, F32(1e-12)).astype(F32) * F32(1.0 / 2688.0)
    v = (h / x_scale[:, None]).astype(F32).reshape(h.shape[0], -1, 16)
    bmax = np.abs(v).max(axis=2)
    bs = np.clip((bmax * F32(1.0 / 6.0)).astype(F32), F32(2.0**-9), F32(448.0)).astype(E4M3)
    q = np.clip((v / bs.astype(F32)[:, :, None]).astype(F32), -6, 6).astype(E2M1)
    codes = q.view(np.uint8).reshape(h.shape[0], -1) & 0xF
    codes = np.where((codes & 7) == 0, 0, codes)  # a negative value rounding to 0 has code 0
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, bs.view(np.uint8), x_scale


def bf16_round(a: np.ndarray) -> np.ndarray:
    return a.astype(F32).astype(BF16).astype(np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _nvfp4_l2(h: np.ndarray, s: float) -> np.ndarray:
    """The kernel's routed L2-input cast, float32 via numpy, returned as e2m1 * bs."""
    h = h.astype(F32).reshape(*h.shape[:-1], -1, 16)
    d = F32(6.0) * F32(s)
    amax = np.minimum(np.abs(h).max(axis=-1), d * F32(448.0))
    bs = np.clip((amax / d).astype(F32), F32(2.0**-9), F32(448.0)).astype(E4M3).astype(F32)
    inv = (F32(1.0) / (bs * F32(s))).astype(F32)
    q = np.clip((h * inv[..., None]).astype(F32), -6, 6).astype(E2M1).astype(np.float64)
    return (q * bs[..., None]).reshape(*h.shape[:-2], -1)


def _mxfp8_l2(h: np.ndarray) -> np.ndarray:
    g = h.astype(F32).reshape(*h.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(g).max(axis=-1, keepdims=True), 2.0**-22 * 448)
    sf = np.exp2(np.ceil(np.log2(amax / 448.0)))
    return ((g / sf).astype(E4M3).astype(np.float64) * sf).reshape(h.shape)


def expert(x, w1, w2, scale1, scale2, clamp, rounding, l2_scale=1.0, shared_fmt=None):
    """One expert on one token, float64. ``rounding``: None (none) or ``"kernel"``."""
    gu = (x @ w1.T) * scale1
    if rounding:
        gu = bf16_round(gu)
    half = w1.shape[0] // 2
    gate, up = gu[:half], gu[half:]
    if clamp is not None:
        gate, up = np.minimum(gate, clamp), np.clip(up, -clamp, clamp)
    h = silu(gate) * up
    if rounding:
        if shared_fmt is None:
            h = _nvfp4_l2(h, l2_scale)
        elif shared_fmt == "fp8":
            h = _mxfp8_l2(h)
        else:
            h = bf16_round(h)
    out = (h @ w2.T) * scale2
    return bf16_round(out) if rounding else out


def dense_moe(case, rounding: str | None = None) -> np.ndarray:
    """float64 ``[T, H]``: the MoE on the staged tokens with the dequantized weights.

    Routed experts use ``W = e2m1 * bs`` with their global scales as the kernel's alphas
    (``l1_alpha * x_scale``, ``l2_alpha``); rows are weighted by the router weight and the
    fused shared expert added with weight 1, all in float64.
    """
    buf, w = case.buf, case.weights
    t = case.t
    x = nvfp4_values(buf.x[:t], buf.x_sf[:t])
    x_scales = buf.x_scales[:t].numpy().astype(np.float64)
    ids, weights = case.topk_idx.numpy(), case.topk_weights.numpy().astype(np.float64)
    w1 = nvfp4_values(*w.l1_raw)
    w2 = nvfp4_values(*w.l2_raw)
    g1, g2 = w.l1_global_scale.numpy(), w.l2_global_scale.numpy()
    s = case.l2_activation_scale
    y = np.zeros((t, buf.hidden), dtype=np.float64)
    shared = None
    if w.shared_l1 is not None:
        shared = tuple(_shared_dense(p) for p in (w.shared_l1_raw, w.shared_l2_raw))
        x_shared = _shared_tokens(case)
    for i in range(t):
        for slot in range(ids.shape[1]):
            e = int(ids[i, slot])
            if e >= 0:
                scale1 = float(F32(x_scales[i]) * F32(g1[e])) if rounding else x_scales[i] * g1[e]
                # The kernel's L2 input is h / s (its scale s is folded into l2_alpha).
                scale2 = float(F32(g2[e]) * F32(s)) if rounding else float(g2[e])
                y[i] += weights[i, slot] * expert(
                    x[i], w1[e], w2[e], scale1, scale2, case.clamp, rounding, s
                )
        if shared is not None:
            fmt = "fp8" if isinstance(w.shared_l1_raw, tuple) else "bf16"
            y[i] += expert(x_shared[i], shared[0], shared[1], 1.0, 1.0, case.clamp, rounding,
                           shared_fmt=fmt)
    return y


def _shared_dense(p) -> np.ndarray:
    if isinstance(p, tuple):
        from reference_oracle import dequantize

        return dequantize(p)
    return bf16_values(p)


def _shared_tokens(case) -> np.ndarray:
    """float64 ``[T, H]`` of the shared expert's staged input (MXFP8 or BF16)."""
    buf, t = case.buf, case.t
    if buf.shared_dtype == torch.bfloat16:
        return bf16_values(buf.shared_l1_acts[:t])
    from reference_oracle import fp8_values, ue8m0_scales

    rows = case.shared_sf_rows
    return fp8_values(buf.shared_l1_acts[:t]) * np.repeat(
        ue8m0_scales(buf.shared_l1_acts_sf[rows]), 32, axis=-1
    )


# --------------------------------------------------------------------------- combine


def combine_base(buf) -> int:
    """The combine region starts where the ``l2_acts_sf`` view ends (vLLM 0.34.0's
    ``layout/nvfp4_mega_moe.cuh``)."""
    view = buf.l2_acts_sf
    return view.data_ptr() + view.numel() * view.element_size() - buf.buffer.data_ptr()


def combine_rows(buf) -> np.ndarray:
    """float64 ``[num_slots, Tmax, H]`` rows read from the raw buffer bytes."""
    tmax, h = buf.num_max_tokens_per_rank, buf.hidden
    base = combine_base(buf)
    raw = np_bytes(buf.buffer)[base : base + buf.num_slots * tmax * h * 2]
    return raw.view(BF16).astype(np.float64).reshape(buf.num_slots, tmax, h)


def round_to_f32(q: Fraction) -> F32:
    """The FP32 nearest to the exact rational ``q`` (ties to even); 0 -> +0."""
    if q == 0:
        return F32(0.0)
    c = F32(float(q))
    cands = [np.nextafter(c, F32(-np.inf)), c, np.nextafter(c, F32(np.inf))]
    best = min(
        cands,
        key=lambda v: (abs(Fraction(float(v)) - q), int(np.array(v).view(np.uint32)) & 1),
    )
    return F32(best)


def resum(rows: np.ndarray, ids: np.ndarray, weights: np.ndarray, t: int, shared: bool,
          mode: str = "fma", order: str = "ascending", shared_at: str = "last") -> np.ndarray:
    """BF16 bits (uint16 ``[T, H]``) of the weighted combine, by exact arithmetic.

    ``mode="fma"``: ``acc = fl(row * w + acc)`` (one rounding); ``"mul_add"``: ``acc =
    fl(fl(row * w) + acc)``. ``order`` of the routed slots and ``shared_at`` ("first" or
    "last") exist to show the data tells the variants apart.
    """
    k = ids.shape[1]
    slots = list(range(k)) if order == "ascending" else list(range(k - 1, -1, -1))
    steps = [(s, None) for s in slots]
    if shared:
        steps = [(k, 1.0), *steps] if shared_at == "first" else [*steps, (k, 1.0)]
    out = np.zeros((t, rows.shape[2]), dtype=np.uint16)
    for i in range(t):
        for j in range(rows.shape[2]):
            acc = F32(0.0)
            for s, fixed in steps:
                if fixed is None and ids[i, s] < 0:
                    continue
                w = F32(fixed if fixed is not None else weights[i, s])
                r = Fraction(float(rows[s, i, j]))
                if mode == "fma":
                    acc = round_to_f32(r * Fraction(float(w)) + Fraction(float(acc)))
                else:
                    p = round_to_f32(r * Fraction(float(w)))
                    acc = round_to_f32(Fraction(float(p)) + Fraction(float(acc)))
            out[i, j] = np.array(acc, dtype=F32).astype(BF16).view(np.uint16)
    return out
