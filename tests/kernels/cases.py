"""Inputs and oracles shared by the interpreter (CPU) and GPU kernel tests."""

from __future__ import annotations

import pytest
import torch

from bitexact import same_bits  # noqa: F401 (kept importable from here)
from moewire import formats
from moewire.format_table import FORMATS as FORMAT_ROWS
from moewire.megamoe.resum import resum

# Every format with a kernel and the ones among them that take an amax: the format table's rows.
FORMATS = tuple(row.name for row in FORMAT_ROWS.values() if row.kernel_code is not None)
NEEDS_AMAX = tuple(name for name in FORMATS if FORMAT_ROWS[name].needs_amax)
DISTRIBUTIONS = ("normal", "heavy", "tiny", "grid", "edges")

# Under the interpreter on CPU where there is no GPU (tests/kernels/conftest.py sets
# TRITON_INTERPRET), compiled on CUDA where there is one.
CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="interpreter",
                 marks=pytest.mark.skipif(CUDA, reason="CUDA present: the compiled kernel "
                                          "runs instead of the interpreter")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def sample(shape, dist: str, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """Fresh random data (never zeros) of one of :data:`DISTRIBUTIONS`.

    ``heavy`` spans many binades (outliers saturate per-tensor scales), ``tiny`` lands in
    the E4M3/E2M1 subnormal ranges of the scaled values, ``grid`` puts many values exactly
    on rounding midpoints (multiples of 2^-4), where ties-to-even decides. ``edges`` cycles
    four kinds of 16-column block: rows of 2^-100 and 2^-94 (where FlashInfer's encoders
    mask their reciprocal), blocks with one value lifted by 2^12 (MoRI's scaled blocks,
    FP8 saturation), and FNUZ/E4M3 ties and saturation (232, 233, 2^-11, 3 * 2^-11, ...).
    """
    if dist == "normal":
        x = torch.randn(shape, generator=gen) * 3
    elif dist == "heavy":
        x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))
    elif dist == "tiny":
        x = torch.randn(shape, generator=gen) * 1e-3
    elif dist == "grid":
        x = torch.randint(-96, 97, shape, generator=gen).float() / 16
    elif dist == "edges":
        x = torch.randn(shape, generator=gen)
        col = torch.arange(shape[-1])
        kind = (col // 16) % 4
        x = x * torch.where(kind == 0, 2.0**-100, torch.where(kind == 1, 2.0**-94, 1.0))
        x = x * torch.where((kind == 2) & (col % 16 == 3), 4096.0, 1.0)
        pool = torch.tensor([232.0, 233.0, 224.0, 240.0, 300.0, 2.0**-11, 3 * 2.0**-11,
                             2.0**-10, 0.75, 5.0])
        ties = pool[torch.randint(0, len(pool), shape, generator=gen)]
        ties = ties * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
        x = torch.where(kind == 3, ties, x)
    else:
        raise ValueError(dist)
    return x.to(dtype)


def amax_for(fmt: str, x: torch.Tensor, scale: float = 0.75) -> torch.Tensor | None:
    """A static amax below the data's max (so some values saturate), FP32 on x's device."""
    if fmt not in NEEDS_AMAX:
        return None
    return (x.float().abs().amax() * scale).reshape(())


def combine_case(
    fmt: str,
    *,
    k: int,
    tmax: int,
    num_tokens: int,
    hidden: int,
    shared_slot: str | None,
    gen: torch.Generator,
    device: str | torch.device = "cpu",
    dist: str = "normal",
):
    """A combine region as a strided view into a flat buffer, like ``combine_rows``.

    Slots with ``topk_idx = -1`` (about a third, and every slot of one token) and the
    tokens past ``num_tokens`` hold stale NaN, which must never reach the output.
    Returns ``(rows, topk_idx, amax)``.
    """
    slots = k + (shared_slot is not None)
    offset = 64
    flat = torch.empty(offset + slots * tmax * hidden, dtype=torch.bfloat16)
    rows = flat[offset:].view(slots, tmax, hidden)
    rows.copy_(sample((slots, tmax, hidden), dist, gen))
    topk_idx = torch.randint(0, 64, (tmax, k), generator=gen)
    topk_idx[torch.rand((tmax, k), generator=gen) < 0.35] = -1
    topk_idx[min(1, num_tokens - 1)] = -1
    # Every build stores a fused shared row at row k, wherever the sum adds it.
    for s in range(k):
        rows[s][topk_idx[:, s] < 0] = float("nan")
    rows[:, num_tokens:] = float("nan")
    amax = amax_for(fmt, rows[:, :num_tokens].nan_to_num(0.0))
    flat = flat.to(device)
    rows = flat[offset:].view(slots, tmax, hidden)
    return rows, topk_idx.to(device), None if amax is None else amax.to(device)


def reference_combine(rows, topk_idx, num_tokens, fmt, amax, shared_slot, weights=None,
                      accumulate="bf16"):
    """The torch definition: ``megamoe.resum`` with the format's reference as quantizer
    (weighted with one FMA rounding per slot when ``weights`` is given; ``accumulate=
    "fp32"`` adds the reference's FP32 values, computed from the widened rows)."""
    ref_fmt = formats.get(fmt)
    if accumulate == "fp32":
        def quantize(r):
            return ref_fmt.reference(r.float(), amax)
    else:
        def quantize(r):
            return ref_fmt.reference(r, amax)
    return resum(
        rows,
        topk_idx,
        num_tokens,
        shared_position=shared_slot,
        weights=weights,
        row_quantizer=quantize,
        accumulate=accumulate,
    )


def router_weights(tmax: int, k: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """FP32 router weights ``[tmax, k]`` with full 24-bit significands (softmax-like values
    in (0, 1)), so a multiply-then-add rounds differently from one FMA on many elements."""
    w = torch.rand((tmax, k), generator=gen, dtype=torch.float64) * 0.9 + 0.05
    return w.float().to(device)


def valid_routed_max(rows, topk_idx, num_tokens, shared_slot) -> torch.Tensor:
    """max |row| over the valid routed rows of the first ``num_tokens`` tokens (FP32)."""
    routed = rows[: topk_idx.shape[1], :num_tokens].float().abs()
    valid = (topk_idx[:num_tokens] >= 0).T.unsqueeze(-1)
    return torch.where(valid, routed, torch.zeros_like(routed)).amax()
