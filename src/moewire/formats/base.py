"""The wire-format interface and its registry.

A wire format says what a number becomes on the wire. Each format is one object with one
reference implementation in plain torch (``reference``) that runs on CPU and CUDA and is the
definition of the format; a fast kernel, where one exists, must equal it bit for bit.

Blocks run along the last dimension: a "row" is ``x[..., :]`` (one token's hidden vector on
the wire), and a block of ``block_size`` consecutive elements of a row shares a scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class WireFormat:
    """One low-precision wire format.

    Attributes:
        name: registry name (``"nvfp4"``).
        element_bits: bits per element on the wire.
        block_size: elements per block scale along the last dim, or ``None`` if the format
            has no block scale (per-tensor or per-row scale only).
        scale_bits: bits of each block scale on the wire (0 without block scales).
        needs_amax: the scale needs a global amax (per-tensor scale, as ModelOpt's static
            FP8 or NVFP4's global scale): ``qdq`` refuses ``amax=None``.
        row_local: every scale of a row depends on that row alone, so two ranks that
            quantize the same row agree whatever else they hold. A format that needs an
            amax is row-local only once that amax is fixed (calibrated or constant).
        row_scale_bits: extra bits per row for a per-row scale (``nvfp4_token``), else 0.
    """

    name: str = ""
    element_bits: float = 16
    block_size: int | None = None
    scale_bits: int = 0
    needs_amax: bool = False
    row_local: bool = True
    row_scale_bits: int = 0

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        """The definition: plain torch, CPU and CUDA. ``x`` is already validated."""
        raise NotImplementedError

    def qdq(self, x: torch.Tensor, amax: torch.Tensor | float | None = None) -> torch.Tensor:
        """Fake-quantize ``x`` (BF16/FP16/FP32, any shape) and return it in ``x.dtype``."""
        x = self.check_input(x)
        return self.reference(x, self.check_amax(amax, x))

    def wire_bits(self, hidden: int) -> float:
        """Bits one row of ``hidden`` elements occupies on the wire, scales included."""
        blocks = 0 if self.block_size is None else math.ceil(hidden / self.block_size)
        return self.element_bits * hidden + self.scale_bits * blocks + self.row_scale_bits

    # -- validation shared by every format ---------------------------------------------

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"format {self.name!r}: x must be a torch.Tensor, got {type(x)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"format {self.name!r}: x has dtype {x.dtype}; fake quantization takes "
                "bfloat16, float16 or float32 tensors (cast integer data first)"
            )
        if x.dim() == 0:
            raise ValueError(f"format {self.name!r}: x must have at least one dimension")
        if self.block_size is not None and x.shape[-1] % self.block_size != 0:
            raise ValueError(
                f"format {self.name!r}: the last dim of x is {x.shape[-1]}, not a multiple of "
                f"the block size {self.block_size}; pad the rows or pick another format"
            )
        return x

    def check_amax(
        self, amax: torch.Tensor | float | None, x: torch.Tensor
    ) -> torch.Tensor | None:
        if amax is None:
            if self.needs_amax:
                raise ValueError(
                    f"format {self.name!r} needs an amax (its scale is global); pass amax= "
                    "from calibration or a constant, e.g. amax=x.abs().amax()"
                )
            return None
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        if amax_t.numel() != 1:
            raise ValueError(
                f"format {self.name!r}: amax must be a scalar, got shape {tuple(amax_t.shape)}"
            )
        return amax_t.reshape(())

    def __repr__(self) -> str:
        return f"<WireFormat {self.name}>"


_REGISTRY: dict[str, WireFormat] = {}


def register(fmt: WireFormat | type[WireFormat]) -> Callable | WireFormat:
    """Register a format instance (or class, instantiated once) under ``fmt.name``."""
    inst = fmt() if isinstance(fmt, type) else fmt
    if not inst.name:
        raise ValueError("a wire format needs a non-empty name")
    if inst.name in _REGISTRY:
        raise ValueError(f"wire format {inst.name!r} is already registered")
    _REGISTRY[inst.name] = inst
    return fmt


def get(name: str | WireFormat) -> WireFormat:
    """The registered format called ``name`` (a format object is returned as is)."""
    if isinstance(name, WireFormat):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown wire format {name!r}; known formats: {known}") from None


def names() -> list[str]:
    """Names of every registered format, sorted."""
    return sorted(_REGISTRY)
