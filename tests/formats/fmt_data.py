"""Fresh random test data for the formats, in several distributions (seeded per case)."""

from __future__ import annotations

import zlib

import numpy as np
import torch

# Grid points and rounding midpoints of E4M3 and E2M1 (in units of the element's scale).
_E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_E2M1_MIDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
_E4M3_MIDS = [(m + 8.5) / 8 * 2.0**e for m in range(8) for e in range(-6, 8)] + [
    (m + 0.5) * 2.0**-9 for m in range(8)
]

KINDS = ["normal", "heavy", "ties", "tiny", "faint", "huge", "one_large", "zero_blocks",
         "nonfinite"]


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def make(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Data of one distribution; rows get scales 2^[-12, 4] so every format meets small
    rows (LogFMT casts only blocks with amax < 1) and large ones."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    hidden = shape[-1]
    if kind == "normal":
        v = rng.standard_normal(n)
    elif kind == "heavy":
        v = rng.standard_t(2.0, n)
        idx = rng.choice(n, size=max(1, n // 200), replace=False)
        v[idx] *= rng.choice([100.0, 1000.0, -1000.0], size=idx.size)
    elif kind == "ties":
        pool = np.array(_E2M1_MIDS + _E2M1_GRID + _E4M3_MIDS)
        v = rng.choice(pool, n) * rng.choice([-1.0, 1.0], n)
        # One anchor per 16 channels pins power-of-two block scales (6 * 2^k for NVFP4 with
        # gs = 1, 448 * 2^k / 1.75 for MX), so the midpoints above are exact ties there.
        anchors = rng.choice([6.0, 448.0, 256.0, 4.0], size=n // 16)
        v.reshape(-1, 16)[:, 0] = anchors * rng.choice([-1.0, 1.0], size=n // 16)
    elif kind == "tiny":
        low = {torch.float32: -140, torch.bfloat16: -133, torch.float16: -24}[dtype]
        v = rng.standard_normal(n) * np.exp2(rng.integers(low, low + 16, n).astype(float))
    elif kind == "faint":
        # Rows of 2^-106 .. 2^-86: normal BF16/FP32 values whose block scales sit where
        # FlashInfer's encoders mask their reciprocal (MXFP8 amax <= 448 * 2^-100, NVFP4
        # amax below ~6e-30) and across the edge of that band. (FP16 flushes them to 0.)
        v = rng.standard_normal(n).reshape(-1, hidden)
        v = v * np.exp2(rng.integers(-106, -85, size=(v.shape[0], 1)).astype(float))
    elif kind == "one_large":
        # One element of every 16 lifted by 2^6 .. 2^16 (or lowered in sign): blocks with
        # one large value, which saturate (OCP MX's floor), overflow FP8 (MoRI's scaled
        # blocks) or leave the rest of the block in the subnormals.
        v = rng.standard_normal(n).reshape(-1, 16)
        lift = np.exp2(rng.integers(6, 17, size=v.shape[0]).astype(float))
        v[np.arange(v.shape[0]), rng.integers(0, 16, size=v.shape[0])] *= lift
        v = v.reshape(-1)
    elif kind == "huge":
        high = {torch.float32: 120, torch.bfloat16: 120, torch.float16: 14}[dtype]
        v = rng.standard_normal(n) * np.exp2(rng.integers(high - 20, high, n).astype(float))
    elif kind == "zero_blocks":
        v = rng.standard_normal(n).reshape(-1, 32)
        v[rng.random(v.shape[0]) < 0.3] = 0.0
        v[rng.random(v.shape[0]) < 0.1] = -0.0
        v = v.reshape(-1)
    elif kind == "nonfinite":
        v = rng.standard_normal(n)
        for bad in (np.nan, -np.nan, np.inf, -np.inf):
            v[rng.choice(n, size=max(1, n // 300), replace=False)] = bad
        # Rows without inf and few NaN, so LogFMT casts some groups that hold a NaN.
        rows = v.reshape(-1, hidden)
        calm = rows[1::2]
        calm[~np.isnan(calm)] = rng.uniform(-0.5, 0.5, int((~np.isnan(calm)).sum()))
    else:
        raise ValueError(kind)
    v = v.reshape(-1, hidden)
    if kind in ("normal", "heavy", "one_large", "zero_blocks", "nonfinite"):
        v = v * np.exp2(rng.integers(-12, 5, size=(v.shape[0], 1)).astype(float))
    t = torch.from_numpy(v.reshape(shape).astype(np.float32))
    return t.to(dtype)


def amax_of(x: torch.Tensor, seed: int) -> float:
    """A calibrated-looking amax: the finite max, sometimes shrunk so values saturate."""
    finite = x.float()[torch.isfinite(x.float())]
    m = float(finite.abs().max()) if finite.numel() else 0.0
    return m * float(np.random.default_rng(seed).choice([1.0, 1.0, 0.5, 0.03]))
