"""Wire formats: what a number becomes on the wire.

``moewire.formats.get(name)`` returns the registered :class:`WireFormat`;
``moewire.fake_quant(x, name, amax=None)`` applies it. The exact math of every format is
in its class docstring and in ``docs/formats.md``; its facts (element, block, scale, kernel)
are its row of ``moewire.format_table``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moewire.format_table import ACCUMULATE_MODES
from moewire.formats import (  # noqa: F401  (registers)
    bf16,
    combine,
    flydsl,
    fp8,
    logfmt,
    mori,
    mx,
    nvfp4,
)
from moewire.formats.base import (
    ModelOptSpelling,
    WireFormat,
    check_table,
    get,
    names,
    register,
)

if TYPE_CHECKING:  # the formats import torch inside their methods: `moewire formats` runs
    import torch  # without it

# Every format registered above has its row of the format table, and every row its format.
check_table()

__all__ = [
    "ACCUMULATE_MODES",
    "ModelOptSpelling",
    "WireFormat",
    "fake_quant",
    "get",
    "names",
    "register",
]


def fake_quant(
    x: torch.Tensor, name: str | WireFormat, amax: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Fake-quantize ``x`` in the wire format ``name``; returns a tensor of ``x.dtype``.

    Args:
        x: BF16/FP16/FP32, any shape; blocks run along the last dim.
        name: a registered format name (``moewire.formats.names()``) or format object.
        amax: the global amax, required by formats with ``needs_amax`` (``fp8``, ``nvfp4``).
    """
    return get(name).qdq(x, amax)
