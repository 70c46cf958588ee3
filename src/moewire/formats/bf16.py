"""``bf16``: the unquantized wire (what vLLM and DeepGEMM send without a quantizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire.formats.base import WireFormat, register


class BF16(WireFormat):
    """BF16 on the wire: identity on BF16 input, one BF16 rounding otherwise.

    Math: ``out = x.to(bfloat16).to(x.dtype)`` (round to nearest even). The Mega-MoE wire
    carries BF16 (staged tokens without FP8, combine rows), so on BF16 data, the only data
    the combine sees, this is the identity (a copy); FP32/FP16 input is rounded as the
    wire would round it. NaN, ±inf and -0.0 pass unchanged. FP16 values above 65280 round
    to 65536 in BF16, beyond FP16's max: ``qdq`` saturates them to 65504 (every format's
    FP16 rule, :meth:`WireFormat.qdq`). No scale, no amax, row-local.
    """

    name = "bf16"

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        return x.to(torch.bfloat16, copy=True).to(x.dtype)


register(BF16)
