"""OCP Microscaling (MX v1.0) wire formats: ``mxfp8`` (E4M3) and ``mxfp4`` (E2M1).

A block of 32 consecutive elements of a row shares one UE8M0 scale (a power of two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire import format_table
from moewire.formats._numerics import (
    E2M1_MAX,
    e2m1_magnitude,
    e4m3,
    floor_log2,
    pow2,
    split_blocks,
)
from moewire.formats.base import ModelOptSpelling, WireFormat, register

# UE8M0 encodes 2^-127 .. 2^127 (0xFF is NaN); a finite FP32 amax never needs more than
# 2^(127 - emax), so only the lower end is clamped.
_E8M0_MIN_EXP = -127


class MXFormat(WireFormat):
    """OCP MX v1.0: UE8M0 scale per 32 elements, elements in E4M3 or E2M1.

    Math per block ``b`` of 32 consecutive elements along the last dim, FP32::

        amax = max|x_b|
        e    = floor(log2(amax)) - emax             # emax 8 (E4M3, 448 = 1.75*2^8),
                                                    #      2 (E2M1, 6 = 1.5*2^2)
        e    = max(e, -127)                         # UE8M0's smallest scale; amax = 0 too
        X    = 2^e
        q    = elem(x_b / X)                        # RNE, saturating at ±max (448 or 6)
        out  = (q * X).to(x.dtype)

    ``floor(log2(amax))`` is read from the exponent bits (exact), not from a rounded
    ``log2``, as hardware does; ``x_b / X`` and ``q * X`` are exact (powers of two), so
    the element rounding is the only rounding before the final cast to ``x.dtype``.
    This is the OCP spec's conversion (section 6.3) and the reference of
    ``microsoft/microxcaling`` with exact exponents. Note it differs from DeepGEMM's
    staging scale ``2^ceil(log2(amax / max))``: with OCP's floor a block's largest
    element can exceed ``max * X`` and saturates.

    Special values: an all-zero block stays zero (signs kept, no NaN). A block holding
    NaN or ±inf has no finite scale (UE8M0 0xFF = NaN in microxcaling) and dequantizes to
    all NaN. -0.0 and values that round to zero keep their sign (E4M3/E2M1 carry one).
    Row-local, no amax.
    """

    def __init__(self, name: str) -> None:
        element = format_table.facts(name).element
        if element not in ("e4m3", "e2m1"):
            raise ValueError(
                f"MX format {name!r}: its element must be 'e4m3' or 'e2m1', got {element!r}; "
                "fix its row in moewire.format_table"
            )
        self.name = name
        self.element = element
        self.emax = 8 if element == "e4m3" else 2
        self.modelopt_spelling = ModelOptSpelling(
            (4, 3) if element == "e4m3" else (2, 1), scale_bits=(8, 0)
        )

    def _round(self, v: torch.Tensor) -> torch.Tensor:
        import torch

        if self.element == "e4m3":
            return e4m3(v)
        return torch.copysign(e2m1_magnitude(v.abs().clamp(max=E2M1_MAX)), v)

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        xb = split_blocks(x, format_table.facts(self.name).block)
        block_amax = xb.abs().amax(dim=-1, keepdim=True)
        finite = torch.isfinite(block_amax)
        # Zero and non-finite blocks get a placeholder amax: any scale gives a zero block
        # zeros, and non-finite blocks are overwritten with NaN below.
        usable = torch.where(finite & (block_amax > 0), block_amax, torch.ones_like(block_amax))
        scale = pow2((floor_log2(usable) - self.emax).clamp(min=_E8M0_MIN_EXP))
        q = self._round(xb * torch.reciprocal(scale))
        out = q * scale
        out = torch.where(finite, out, torch.full_like(out, float("nan")))
        return out.reshape(x.shape).to(x.dtype)


register(MXFormat("mxfp8"))
register(MXFormat("mxfp4"))
