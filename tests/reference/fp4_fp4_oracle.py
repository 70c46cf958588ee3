"""Independent oracles for the stand-in NVFP4 x NVFP4 kernel: numpy float32/float64 and
ml_dtypes only (nothing here calls moewire's casts).

Written from DeepGEMM 2.8.0's kernel source (``impls/sm100_fp4_fp4_mega_moe.cuh`` at 794783a)
and vLLM main's staging (``deepseek_v32/nvidia/ops/prepare_megamoe_nvfp4.py``, 05be1d5):
the staging cast redone in numpy float32, the expert rows with the kernel's rounding points
in float32/ml_dtypes, the MoE without rounding in float64, and the combine's sequential FP32
sum read from the buffer's last bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from reference_oracle import BF16, E2M1, E4M3, bf16_values, fp4_values, np_bytes

F32 = np.float32


def e4m3(v: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 (RNE, saturating at 448, ``satfinite``) -> float32."""
    return np.clip(v.astype(F32), F32(-448.0), F32(448.0)).astype(E4M3).astype(F32)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (RNE, saturating at 6; a value rounding to 0 gets code 0)."""
    codes = np.clip(v.astype(F32), -6, 6).astype(E2M1).view(np.uint8) & 0xF
    return np.where((codes & 7) == 0, 0, codes).astype(np.uint8)


def e2m1_value(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(E2M1).astype(F32)


def scales_of(packed: torch.Tensor) -> np.ndarray:
    """float64 ``[..., 4C]`` E4M3 scales of int32 ``[..., C]`` (byte j of int i: block 4i+j)."""
    return np_bytes(packed).view(E4M3).astype(np.float64)


def nvfp4_values(packed: torch.Tensor, sf: torch.Tensor) -> np.ndarray:
    return fp4_values(packed) * np.repeat(scales_of(sf), 16, axis=-1)


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=F32).astype(BF16).astype(F32)


def stage(hidden: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """vLLM main's staging: ``(x bytes uint8 [T, H/2], x_sf bytes uint8 [T, H/16])``."""
    h = hidden.float().numpy().astype(F32).reshape(hidden.shape[0], -1, 16)
    sf = e4m3(np.maximum((np.abs(h).max(axis=2) * F32(1.0 / 6.0)).astype(F32), F32(2.0**-9)))
    codes = e2m1_codes((h / sf[:, :, None]).astype(F32)).reshape(hidden.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sf.astype(E4M3).view(np.uint8)


def _silu(g: np.ndarray) -> np.ndarray:
    return (g / (F32(1.0) + np.exp(-g).astype(F32))).astype(F32)


def expert_row(x, w1, w2, a1, a2, l2a, weight, clamp) -> np.ndarray:
    """One routed row with the kernel's rounding points (float32 / ml_dtypes); the GEMMs
    in float64 (exact products, another summation order than the hardware's)."""
    acc = x @ w1.T
    half = w1.shape[0] // 2
    gate = bf16((acc[:half]).astype(F32) * F32(a1[0]))
    up = bf16((acc[half:]).astype(F32) * F32(a1[1]))
    if clamp is not None:
        c = bf16(np.array(clamp))
        gate, up = np.minimum(gate, c), np.clip(up, -c, c)
    h = (_silu(gate) * up).astype(F32).reshape(-1, 16)
    inv = F32(1.0) / F32(a2)
    amax = np.abs(h).max(axis=1)
    sf = e4m3(np.maximum(((amax * F32(1.0 / 6.0)).astype(F32) * inv).astype(F32), F32(2.0**-9)))
    q = e2m1_value(e2m1_codes((h * (inv / sf)[:, None].astype(F32)).astype(F32)))
    h_in = (q * sf[:, None]).reshape(-1).astype(np.float64)
    pre = bf16((h_in @ w2.T).astype(F32) * (F32(l2a) * F32(a2)))
    return bf16(pre * F32(weight))


def shared_row(x_bf16, s1, s2, clamp) -> np.ndarray:
    """The BF16 shared expert's row on one token (s1 rows ``[gate | up]``)."""
    acc = x_bf16 @ s1.T
    half = s1.shape[0] // 2
    gate, up = bf16(acc[:half]), bf16(acc[half:])
    if clamp is not None:
        c = bf16(np.array(clamp))
        gate, up = np.minimum(gate, c), np.clip(up, -c, c)
    h = bf16(_silu(gate) * up).astype(np.float64)
    return bf16(h @ s2.T)


def routed_rows(case) -> np.ndarray:
    """float32 ``[k, T, H]`` oracle rows of the valid slots (NaN elsewhere)."""
    buf, w, t = case.buf, case.weights, case.t
    x = nvfp4_values(buf.x[:t], buf.x_sf[:t])
    w1, w2 = nvfp4_values(*w.l1_raw), nvfp4_values(*w.l2_raw)
    a1, l2a = w.l1_alphas.cpu().numpy(), w.l2_alphas.cpu().numpy()
    a2 = np.ones(w1.shape[0], F32) if case.a2_scales is None else case.a2_scales.cpu().numpy()
    ids, weights = case.topk_idx.cpu().numpy(), case.topk_weights.cpu().numpy()
    out = np.full((ids.shape[1], t, buf.hidden), np.nan, F32)
    for i in range(t):
        for s in range(ids.shape[1]):
            e = int(ids[i, s])
            if e >= 0:
                out[s, i] = expert_row(x[i], w1[e], w2[e], a1[e], a2[e], l2a[e], weights[i, s],
                                       case.clamp)
    return out


def dense_moe(case) -> np.ndarray:
    """float64 ``[T, H]``: ``rsf * sum_s w_s * expert_s(x) + shared(x)`` on the staged
    tokens and dequantized weights, without any rounding."""
    buf, w, t = case.buf, case.weights, case.t
    x = nvfp4_values(buf.x[:t], buf.x_sf[:t])
    w1, w2 = nvfp4_values(*w.l1_raw), nvfp4_values(*w.l2_raw)
    a1, l2a = w.l1_alphas.cpu().numpy(), w.l2_alphas.cpu().numpy()
    ids, weights = case.topk_idx.cpu().numpy(), case.topk_weights.cpu().numpy()
    y = np.zeros((t, buf.hidden))
    half = w1.shape[1] // 2
    for i in range(t):
        for s in range(ids.shape[1]):
            e = int(ids[i, s])
            if e >= 0:
                acc = x[i] @ w1[e].T
                gate, up = acc[:half] * a1[e, 0], acc[half:] * a1[e, 1]
                if case.clamp is not None:
                    gate, up = np.minimum(gate, case.clamp), np.clip(up, -case.clamp, case.clamp)
                h = gate / (1 + np.exp(-gate)) * up
                y[i] += weights[i, s] * (h @ w2[e].T) * l2a[e]
    y *= case.routed_scaling_factor
    if w.shared_l1 is not None:
        s1, s2 = bf16_values(w.shared_l1_raw), bf16_values(w.shared_l2_raw)
        xs = bf16_values(case.x)
        for i in range(t):
            acc = xs[i] @ s1.T
            gate, up = acc[: s1.shape[0] // 2], acc[s1.shape[0] // 2 :]
            if case.clamp is not None:
                gate, up = np.minimum(gate, case.clamp), np.clip(up, -case.clamp, case.clamp)
            y[i] += (gate / (1 + np.exp(-gate)) * up) @ s2.T
    return y


def combine_rows(buf) -> np.ndarray:
    """float32 ``[num_slots, Tmax, H]``: the buffer's last ``num_slots * Tmax * H * 2`` bytes
    (DeepGEMM 2.8.0's combine region is its buffer's last region)."""
    tmax, h = buf.num_max_tokens_per_rank, buf.hidden
    raw = np_bytes(buf.buffer)
    nbytes = buf.num_slots * tmax * h * 2
    return raw[raw.size - nbytes :].view(BF16).astype(F32).reshape(buf.num_slots, tmax, h)


def combine(rows: np.ndarray, ids: np.ndarray, t: int, shared: bool, rsf: float,
            order: str = "ascending", finish: str = "kernel",
            shared_at: str = "last") -> np.ndarray:
    """BF16 bits (uint16 ``[T, H]``) of the combine, numpy float32 sequential sums.

    ``order``: ``"ascending"`` or ``"descending"`` routed slots; ``finish``: ``"kernel"`` (the
    routed sum rounded to BF16 and scaled when shared or ``rsf != 1``) or ``"plain"`` (one
    rounding at the end, the factor applied in FP32); ``shared_at``: ``"last"``/``"first"``.
    The variants exist to show the data tells them apart.
    """
    k = ids.shape[1]
    slots = range(k) if order == "ascending" else range(k - 1, -1, -1)
    s = F32(rsf)
    out = np.zeros((t, rows.shape[2]), F32)
    for i in range(t):
        acc = np.zeros(rows.shape[2], F32)
        if shared and shared_at == "first":
            acc = (acc + rows[k, i]).astype(F32)
        for slot in slots:
            if ids[i, slot] >= 0:
                acc = (acc + rows[slot, i]).astype(F32)
        if finish == "kernel" and (shared or s != F32(1.0)):
            acc = bf16(acc)
            if s != F32(1.0):
                acc = bf16(acc * s)
        elif s != F32(1.0):
            acc = (acc * s).astype(F32)
        if shared and shared_at == "last":
            acc = (acc + rows[k, i]).astype(F32)
        out[i] = acc
    return out.astype(BF16).view(np.uint16)
