"""A layout-free oracle of the tiny DeepSeek-V4 experts (``_tiny.deepseek_v4_checkpoints``):
each combine row computed per (token, slot) from the expert weights, never read from a
buffer, then re-summed as DeepGEMM's combine does.

Independent of moewire: NumPy, ml_dtypes and torch's own ``silu`` (the activation, applied to
FP32 vectors of 512 elements as the stand-in kernel applies it). With the checkpoint's
weights (every L1 weight ``code * 2^-4``, one L2 weight per output row) and tokens whose
magnitudes lie in ``[0.5, 1]`` (:func:`tokens`), every FP32 sum the kernel makes is exact, so
the oracle equals the kernel bit for bit whatever the order of its additions: the staged
tokens are integers times ``2^-5`` below 2^5, L1's products integers below 2^8 times one
quantum, a sum of 512 of them below 2^17 quanta; each combine row is a single product.

The kernel's rounding points (DeepGEMM ``impls/sm100_fp8_fp4_mega_moe.cuh``): tokens staged
FP8 E4M3 with a UE8M0 scale per 32 (``amax * fl(1/448)``, amax clamped at 1e-4), L1 rounded
to BF16, the SwiGLU clamp and ``silu(gate) * up * weight`` in FP32, re-quantized to FP8 per
32 (``amax / 448``, no clamp), each row rounded to BF16, the valid slots summed in ascending
order in FP32 from +0.0 and rounded to BF16 once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megamoe"))
import mm_oracles  # noqa: E402  (ModelOpt 0.47's FP8 and NVFP4, NumPy)

F32 = np.float32


def weights(bf16_checkpoint: Path, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 L1 ``[E, 2I, H]`` (``[gate | up]``) and L2 ``[E, H, I]`` of one layer, read
    from the BF16 twin's file (DeepSeek-V4's ``ffn.experts.E.w{1,3,2}``), which holds the FP4
    checkpoint's values exactly."""
    from safetensors.torch import load_file

    tensors = load_file(Path(bf16_checkpoint) / "model.safetensors")
    prefix = f"model.layers.{layer}.ffn.experts"
    count = len({k[len(prefix) + 1 :].split(".")[0] for k in tensors if k.startswith(prefix + ".")})
    l1 = torch.stack([torch.cat([tensors[f"{prefix}.{e}.w1.weight"],
                                 tensors[f"{prefix}.{e}.w3.weight"]]) for e in range(count)])
    l2 = torch.stack([tensors[f"{prefix}.{e}.w2.weight"] for e in range(count)])
    return l1.double(), l2.double()


def tokens(t: int, hidden: int, seed: int) -> torch.Tensor:
    """BF16 ``[t, hidden]`` with magnitudes in ``[0.5, 1]`` and random signs."""
    g = torch.Generator().manual_seed(seed)
    mag = 0.5 + 0.5 * torch.rand((t, hidden), generator=g)
    sign = torch.where(torch.rand((t, hidden), generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).bfloat16()


def routing(t: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[t, top_k]`` distinct expert ids (token 0's last slot invalid, ``-1``) and
    FP32 router weights in ``[0.1, 2.5)``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
    idx[0, -1] = -1
    w = (0.1 + 2.4 * torch.rand((t, top_k), generator=g)).float()
    return idx, w


def _pow2_ceil(a: np.ndarray) -> np.ndarray:
    """The smallest power of two >= ``a`` (FP32), ``2^-126`` for zero."""
    m, e = np.frexp(a.astype(F32))
    p = np.ldexp(F32(1.0), np.where(m == 0.5, e - 1, e)).astype(F32)
    return np.where(a > 0, p, F32(2.0**-126)).astype(F32)


def _e4m3(a: np.ndarray) -> np.ndarray:
    return a.astype(F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=F32).astype(ml_dtypes.bfloat16).astype(F32)


def _fp8_per_32(x: np.ndarray, staging: bool) -> np.ndarray:
    """Values of ``x`` cast to FP8 E4M3 with a UE8M0 scale per 32 (FP32 out)."""
    groups = x.astype(F32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    if staging:
        amax = np.maximum(amax, F32(1e-4)) * F32(1.0 / 448.0)
    else:
        amax = (amax / F32(448.0)).astype(F32)
    sf = _pow2_ceil(amax)
    return (_e4m3(groups * (F32(1.0) / sf)) * sf).astype(F32).reshape(x.shape)


def rows(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, l1: torch.Tensor,
         l2: torch.Tensor, clamp: float | None) -> np.ndarray:
    """Every combine row, from the weights: FP32 (BF16 values) ``[k, T, H]``, zero where the
    slot is invalid.

    Args:
        x: the tokens the kernel is staged with (BF16 ``[T, H]``).
        idx, w: ids ``[T, k]`` (``-1`` invalid) and FP32 router weights.
        l1, l2: float64 dequantized weights ``[E, 2I, H]`` (``[gate | up]``) and ``[E, H, I]``.
        clamp: the SwiGLU limit, or ``None``.
    """
    xs = _fp8_per_32(x.float().numpy(), staging=True).astype(np.float64)
    t, k = idx.shape
    out = np.zeros((k, t, l2.shape[1]), dtype=F32)
    inter = l2.shape[2]
    for s in range(k):
        valid = np.nonzero(idx[:, s].numpy() >= 0)[0]
        if valid.size == 0:
            continue
        e = idx[valid, s].numpy()
        gu = _bf16(np.einsum("tij,tj->ti", l1.numpy()[e], xs[valid]).astype(F32))
        gate, up = gu[:, :inter], gu[:, inter:]
        if clamp is not None:
            gate, up = np.minimum(gate, F32(clamp)), np.clip(up, F32(-clamp), F32(clamp))
        act = torch.nn.functional.silu(torch.from_numpy(gate.copy())).numpy() * up
        h = (act * w[valid, s].numpy()[:, None]).astype(F32)
        h_in = _fp8_per_32(h, staging=False).astype(np.float64)
        out[s, valid] = _bf16(np.einsum("tij,tj->ti", l2.numpy()[e], h_in).astype(F32))
    return out


def resum(r: np.ndarray, idx: torch.Tensor, quant=None) -> torch.Tensor:
    """The combine: valid slots ascending, FP32 from +0.0, one BF16 rounding (``quant``
    applied to each row first); BF16 ``[T, H]``."""
    bits = mm_oracles.resum(r, idx.numpy(), idx.shape[0], quant=quant)
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def predict(x, idx, w, l1, l2, clamp, dispatch_amax=None, combine_amax=None):
    """``(y, rows)`` of one Mega-MoE call: unquantized (amaxes ``None``) or with a ModelOpt
    per-tensor FP8 dispatch quantizer and an NVFP4 combine quantizer of these amaxes."""
    if dispatch_amax is not None:
        xq = mm_oracles.fp8_tensor(x.float().numpy(), dispatch_amax)
        x = torch.from_numpy(xq).bfloat16()
    r = rows(x, idx, w, l1, l2, clamp)
    quant = None if combine_amax is None else (lambda row: mm_oracles.nvfp4(row, combine_amax))
    return resum(r, idx, quant), r


def calibrated_amaxes(x, idx, w, l1, l2, clamp) -> tuple[float, float]:
    """What moewire's calibration collects: ``max|x|`` over tokens with a valid slot, and
    ``max|row|`` over valid rows of the unquantized call."""
    valid = (idx >= 0).any(dim=1)
    r = rows(x, idx, w, l1, l2, clamp)
    slots = (idx >= 0).T.numpy()
    return float(x[valid].float().abs().max()), float(np.abs(r[slots]).max())
