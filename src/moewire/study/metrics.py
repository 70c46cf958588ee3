"""Error metrics of a quantized layer output against the unquantized one.

All metrics are computed in float64 over every element of every evaluation batch taken
together (the batches are concatenated along the token dim before the sums), with
``y`` the quantized output and ``r`` the reference output, both ``[N, H]``:

- ``rel_l2 = ||y - r||_2 / ||r||_2``;
- ``sqnr_db = 10 * log10(sum(r^2) / sum((y - r)^2))``; ``+inf`` when ``y == r``
  exactly (written as the string ``"inf"`` in ``results.json``);
- ``cosine = <y, r> / (||y||_2 * ||r||_2)`` over the flattened tensors;
- ``max_abs_err = max |y - r|``.

Degenerate references: with ``||r|| = 0`` the relative error is 0 when ``y`` is also
zero and ``+inf`` otherwise, SQNR is ``+inf`` when the error is zero and ``-inf``
otherwise, and the cosine of two zero tensors is 1 (of one zero tensor, 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class ErrorMetrics:
    """The four error metrics of one output (see the module docstring)."""

    rel_l2: float
    sqnr_db: float
    cosine: float
    max_abs_err: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _check_pair(y: torch.Tensor, ref: torch.Tensor) -> None:
    if not isinstance(y, torch.Tensor) or not isinstance(ref, torch.Tensor):
        raise TypeError("error_metrics: y and ref must be torch.Tensors")
    if y.shape != ref.shape:
        raise ValueError(
            f"error_metrics: y has shape {tuple(y.shape)} but ref has {tuple(ref.shape)}; "
            "compare outputs of the same batches"
        )
    if y.numel() == 0:
        raise ValueError("error_metrics: empty outputs; evaluate at least one token")


def error_metrics(y: torch.Tensor, ref: torch.Tensor) -> ErrorMetrics:
    """Relative L2, SQNR (dB), cosine and max abs error of ``y`` against ``ref``.

    Args:
        y: the quantized layer output, any float dtype, ``[N, H]`` (any shape works).
        ref: the unquantized output, same shape.

    Returns:
        :class:`ErrorMetrics` of Python floats (``inf`` where the module docstring says).

    Raises:
        ValueError: shapes differ, or the tensors are empty.
        TypeError: an argument is not a tensor.
    """
    _check_pair(y, ref)
    y64 = y.detach().to("cpu", torch.float64).reshape(-1)
    r64 = ref.detach().to("cpu", torch.float64).reshape(-1)
    err = y64 - r64
    err_sq = float(err.square().sum())
    ref_sq = float(r64.square().sum())
    y_sq = float(y64.square().sum())

    if ref_sq > 0.0:
        rel_l2 = math.sqrt(err_sq / ref_sq)
    else:
        rel_l2 = 0.0 if err_sq == 0.0 else math.inf
    if err_sq == 0.0:
        sqnr_db = math.inf
    elif ref_sq == 0.0:
        sqnr_db = -math.inf
    else:
        sqnr_db = 10.0 * math.log10(ref_sq / err_sq)
    if ref_sq == 0.0 and y_sq == 0.0:
        cosine = 1.0
    elif ref_sq == 0.0 or y_sq == 0.0:
        cosine = 0.0
    else:
        cosine = float((y64 * r64).sum()) / math.sqrt(y_sq * ref_sq)
    max_abs = float(err.abs().max())
    return ErrorMetrics(rel_l2=rel_l2, sqnr_db=sqnr_db, cosine=cosine, max_abs_err=max_abs)
