"""What every launch checks first, and where the Triton module comes from.

Whether the kernels can run here (:func:`available`), which formats have one
(:func:`supports`), and the argument checks the entry points share (device, format, amax,
blocks). A format comes in as its row of ``moewire.format_table`` (``WireFormat.facts``) or
as its name, looked up there. Imports Triton only when a kernel is launched.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

from moewire.extras import install_command
from moewire.format_table import ACCUMULATE_MODES, FORMATS, SHARED_POSITIONS, FormatFacts, find

__all__ = ["ACCUMULATE_MODES", "SHARED_POSITIONS", "SUPPORTED_FORMATS", "available", "supports"]

#: The formats with a kernel: the rows of the format table with a ``kernel_code``.
SUPPORTED_FORMATS = tuple(row.name for row in FORMATS.values() if row.kernel_code is not None)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when the Triton kernels can run on CUDA tensors in this process.

    False without CUDA, without an importable Triton, or with ``MOEWIRE_DISABLE_KERNELS=1``
    (then every caller takes the torch reference path).
    """
    if os.environ.get("MOEWIRE_DISABLE_KERNELS", "0") == "1":
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _kernel_row(fmt: FormatFacts | str) -> FormatFacts | None:
    """The row of ``fmt`` (a row, or a name looked up in the table) if it has a kernel."""
    row = fmt if isinstance(fmt, FormatFacts) else find(fmt) if isinstance(fmt, str) else None
    return row if row is not None and row.kernel_code is not None else None


def supports(fmt: FormatFacts | str) -> bool:
    """True when a kernel exists for the wire format ``fmt``: its row of
    ``moewire.format_table`` (``WireFormat.facts``) or its registry name."""
    return _kernel_row(fmt) is not None


def _impl() -> ModuleType:
    try:
        from moewire.kernels import _triton
    except ImportError as exc:
        raise RuntimeError(
            "moewire.kernels: Triton is not importable here; install the GPU extra "
            f"({install_command('gpu')}) or use the torch reference (formats.get(name).reference)"
        ) from exc
    return _triton


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.is_cuda or (_interpreting() and t.device.type == "cpu"):
        return
    raise RuntimeError(
        f"moewire.kernels: {what} is on {t.device}; the Triton kernels run on CUDA tensors "
        "(or on CPU under TRITON_INTERPRET=1); use the torch reference elsewhere"
    )


def _check_format(fmt: FormatFacts | str) -> FormatFacts:
    """The row of ``fmt``, refused unless it has a kernel."""
    row = _kernel_row(fmt)
    if row is None:
        name = fmt.name if isinstance(fmt, FormatFacts) else fmt
        raise ValueError(
            f"moewire.kernels: no kernel for wire format {name!r}; supported: "
            f"{', '.join(SUPPORTED_FORMATS)} (use formats.get(name).reference for the others)"
        )
    return row


def _amax_tensor(
    row: FormatFacts, amax: torch.Tensor | float | None, device: torch.device
) -> torch.Tensor | None:
    """The FP32 ``[1]`` amax on ``device`` for the per-tensor formats, else ``None``."""
    if not row.needs_amax:
        return None
    if amax is None:
        raise ValueError(
            f"moewire.kernels: format {row.name!r} needs an amax (its scale is global); pass "
            "the calibrated or constant FP32 amax tensor"
        )
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    if amax_t.numel() != 1:
        raise ValueError(
            f"moewire.kernels: amax must hold one element, got shape {tuple(amax_t.shape)}"
        )
    # A no-op for a device FP32 tensor; a host number is copied once (outside graphs).
    return amax_t.reshape(1).to(device)


def _check_blocks(what: str, hidden: int, row: FormatFacts) -> None:
    """``hidden`` holds whole blocks of the format (its row's block)."""
    if hidden % row.block:
        raise ValueError(
            f"{what}={hidden} is not a multiple of {row.name}'s block size {row.block}"
        )


def _triton_mod() -> ModuleType:
    import triton

    module: ModuleType = triton
    return module


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__
