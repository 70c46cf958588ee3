"""Independent NumPy / ml_dtypes oracles for the megamoe tests (DeepGEMM's combine order,
ModelOpt 0.47's formats).

Nothing here imports moewire's formats, quantizer or megamoe code.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

F32 = np.float32


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> BF16 (round to nearest even) as uint16 bits."""
    return np.asarray(a, dtype=F32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> BF16 -> float32."""
    return np.asarray(a, dtype=F32).astype(ml_dtypes.bfloat16).astype(F32)


def torch_bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def resum(rows, topk_idx, t, shared_slot=None, quant=None):
    """The kernel's combine per token: valid slots in ascending order, FP32 accumulation
    from +0 with float32 scalars, shared row (stored at index k) unquantized, added first or
    last, one BF16 rounding.

    Args:
        rows: float32 ``[num_slots, Tmax, H]`` (BF16 values).
        topk_idx: int ``[>= t, k]``.
        quant: row -> row (float32, BF16 values), applied to routed rows only.

    Returns:
        uint16 BF16 bits ``[t, H]``.
    """
    k = topk_idx.shape[1]
    routed = rows[:k]
    out = np.zeros((t, rows.shape[2]), dtype=np.uint16)
    for tok in range(t):
        acc = np.zeros(rows.shape[2], dtype=F32)
        terms = [rows[k, tok]] if shared_slot == "first" else []
        for s in range(k):
            if topk_idx[tok, s] >= 0:
                r = routed[s, tok]
                terms.append(quant(r) if quant is not None else r)
        if shared_slot == "last":
            terms.append(rows[k, tok])
        for term in terms:
            acc = (acc + np.asarray(term, dtype=F32)).astype(F32)
        out[tok] = bf16_bits(acc)
    return out


def e4m3(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def fp8_tensor(x: np.ndarray, amax: float) -> np.ndarray:
    """ModelOpt per-tensor FP8 (ModelOpt 0.47): ``s = 448 * fl(1/safe)``, two FP32 roundings."""
    amax = F32(amax)
    safe = amax if amax > F32(2.0**-24) else F32(1.0)
    s = F32(F32(448.0) * F32(F32(1.0) / safe))
    q = e4m3(np.clip(np.asarray(x, F32) * s, -448, 448).astype(F32))
    return bf16_round((q * F32(F32(1.0) / s)).astype(F32))


def _e2m1(a: np.ndarray) -> np.ndarray:
    """E2M1 magnitude rounding with ModelOpt 0.47's thresholds (ties as listed)."""
    out = np.full(a.shape, 6.0, dtype=F32)
    for upper, value, inclusive in [
        (5.0, 4.0, True),
        (3.5, 3.0, False),
        (2.5, 2.0, True),
        (1.75, 1.5, False),
        (1.25, 1.0, True),
        (0.75, 0.5, False),
        (0.25, 0.0, True),
    ]:
        hit = a <= upper if inclusive else a < upper
        out = np.where(hit, F32(value), out)
    return out


def nvfp4(x: np.ndarray, amax: float) -> np.ndarray:
    """ModelOpt NVFP4 (ModelOpt 0.47) along the last dim, blocks of 16; BF16 out."""
    x = np.asarray(x, dtype=F32)
    amax = F32(amax)
    gs = F32(amax * (F32(1) / F32(6 * 448))) if amax > 0 else F32(1e-12)  # CUDA's a * fl(1/c)
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    bmax = np.abs(blocks).max(axis=-1, keepdims=True)
    bs = e4m3(np.minimum(bmax / F32(F32(6.0) * gs), F32(448)).astype(F32)) * gs
    bs = np.where(bs < F32(1e-5), F32(1.0), bs).astype(F32)
    q = _e2m1((np.abs(blocks) / bs).astype(F32))
    return bf16_round((np.sign(blocks) * q * bs).astype(F32).reshape(x.shape))


def mxfp8(x: np.ndarray) -> np.ndarray:
    """OCP MXFP8 (E4M3, emax 8), blocks of 32, scale ``2^(floor(log2 amax) - 8)``; BF16 out."""
    x = np.asarray(x, dtype=F32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    _, e = np.frexp(np.where(amax > 0, amax, F32(1.0)))
    scale = np.ldexp(F32(1.0), (e - 1 - 8).astype(np.int32)).astype(F32)
    q = e4m3(np.clip(blocks / scale, -448, 448).astype(F32)) * scale
    return bf16_round(np.where(amax > 0, q, F32(0.0)).reshape(x.shape))
