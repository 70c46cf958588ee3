"""Fast Triton kernels for moewire's row-local wire formats (GPU only).

Two entry points, each bit-exact to the torch definitions in ``moewire.formats`` and
``moewire.megamoe.resum`` (which give the same bits on CPU and CUDA):

- :func:`qdq`: fake quantization of ``[..., H]`` tensors (the dispatch quantizer);
- :func:`fused_combine`: the combine re-sum in one pass over the combine rows: each valid
  row is loaded once, fake-quantized in registers, accumulated in FP32 in ascending slot
  order (router-weighted with one FMA rounding for the NVFP4 kernel's unweighted rows)
  with the fused shared row in its place, rounded once to BF16 and written to ``out``; in
  the same pass, optionally, the layout check (the unquantized sum compared bitwise with
  the kernel's ``y``) and the calibration max over valid rows.

Both are CUDA-graph safe: no host synchronisation, and the grid depends only on shapes.
This package imports nothing from moewire's other packages but the format table
(``moewire.format_table``, below it): a format comes in as its row there (a
``FormatFacts``, ``WireFormat.facts``) or its name, and its amax as a plain FP32 device
tensor.

``available()`` says whether the kernels can run here (CUDA and Triton importable, and the
environment variable ``MOEWIRE_DISABLE_KERNELS`` not set to ``1``). Under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the first import of Triton) the same
kernels also run on CPU tensors, which is how the tests check them without a GPU.

The API lives in named modules and is re-exported here (``moewire.kernels.<name>``):
``launch`` (:func:`available`, :func:`supports`, the shared checks),
``fake_quant`` (:func:`qdq`), ``combine`` (:func:`fused_combine`,
:func:`check_combine_args`), ``tuning`` (program sizes), ``_triton`` (the kernels).
"""

from __future__ import annotations

from moewire.kernels.combine import check_combine_args, fused_combine
from moewire.kernels.fake_quant import qdq
from moewire.kernels.launch import (
    ACCUMULATE_MODES,
    SHARED_POSITIONS,
    SUPPORTED_FORMATS,
    available,
    supports,
)

__all__ = [
    "ACCUMULATE_MODES",
    "SHARED_POSITIONS",
    "SUPPORTED_FORMATS",
    "available",
    "check_combine_args",
    "fused_combine",
    "qdq",
    "supports",
]
