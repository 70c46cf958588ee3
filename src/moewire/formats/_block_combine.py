"""The reference shared by the real kernels' block-scaled combine formats
(:mod:`moewire.formats.combine`, :mod:`moewire.formats.mori`): blocks, their amax, and the
rule that a block holding NaN or ±inf comes out all NaN (the sources leave that case open,
or differ in it, and a healthy model's combine rows are finite).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire import format_table
from moewire.formats._numerics import split_blocks
from moewire.formats.base import WireFormat


class BlockCombineFormat(WireFormat):
    """The reference shared by the real kernels' block-scaled combine formats (their rows in
    ``moewire.format_table``: row-local, no amax, FP32 accumulation in the kernel); no
    ModelOpt spelling (a cfg names them with ``format``).

    :meth:`reference` is the part every such format shares: split the row into blocks of
    ``block_size``, take each block's amax, let :meth:`_qdq_blocks` quantize and dequantize
    the blocks with the format's own math, and set every block holding NaN or ±inf to NaN.
    """

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        xb = split_blocks(x, format_table.facts(self.name).block)
        block_amax = xb.abs().amax(dim=-1, keepdim=True)
        finite = torch.isfinite(block_amax)
        out = self._qdq_blocks(xb, torch.where(finite, block_amax, torch.zeros_like(block_amax)))
        out = torch.where(finite, out, torch.full_like(out, float("nan")))
        return out.reshape(x.shape).to(x.dtype)

    def _qdq_blocks(self, xb: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
        """The format's fake quant of its blocks (the math in the class docstring).

        Args:
            xb: FP32 ``[..., H // block_size, block_size]``, read only.
            block_amax: FP32 ``[..., H // block_size, 1]``, ``max|x_b|``; ``0`` for a block
                holding NaN or ±inf, whose result :meth:`reference` replaces by NaN.

        Returns:
            FP32, the shape of ``xb``: the dequantized blocks.
        """
        raise NotImplementedError
