"""What every launch checks first, and where the Triton module comes from.

Whether the kernels can run here (:func:`available`), which formats have one
(:func:`supports`), and the argument checks the entry points share (device, format, amax,
blocks). Imports Triton only when a kernel is launched.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

__all__ = ["SHARED_POSITIONS", "SUPPORTED_FORMATS", "available", "supports"]

SUPPORTED_FORMATS = (
    "bf16",
    "fp8",
    "fp8_b128",
    "fp8_b128_ue8m0",
    "fp8_b32_ue8m0",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "nvfp4_token",
    "deepgemm_fp8_combine",
    "trtllm_32e4m3xe8m0",
    "te_mxfp8",
    "trtllm_16e2m1xbf16",
    "fp8_e4m3fnuz",
    "flashinfer_mxfp8",
    "flashinfer_nvfp4",
    "mori_fp8_blockwise_fnuz",
    "mori_fp8_blockwise_ocp",
    "mori_fp8_direct_cast_fnuz",
    "mori_fp8_direct_cast_ocp",
)
# How a combine adds its dequantized rows: rounded to BF16 first (QDQ), or as FP32 values
# (moewire.formats.ACCUMULATE_MODES; kernels import nothing above them, so it is repeated).
ACCUMULATE_MODES = ("bf16", "fp32")
# Where a fused shared row (stored at row ``k`` in every build) is added to the combine sum:
# not at all, before the routed slots, or after them. The one definition; ``megamoe``
# re-exports it.
SHARED_POSITIONS = (None, "first", "last")
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


def supports(fmt_name: str) -> bool:
    """True when a kernel exists for the wire format ``fmt_name`` (a registry name)."""
    return fmt_name in SUPPORTED_FORMATS


def _impl() -> ModuleType:
    try:
        from moewire.kernels import _triton
    except ImportError as exc:
        raise RuntimeError(
            "moewire.kernels: Triton is not importable here; install the GPU extra "
            "(pip install 'moewire[gpu]') or use the torch reference (formats.get(name).reference)"
        ) from exc
    return _triton


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.is_cuda or (_interpreting() and t.device.type == "cpu"):
        return
    raise RuntimeError(
        f"moewire.kernels: {what} is on {t.device}; the Triton kernels run on CUDA tensors "
        "(or on CPU under TRITON_INTERPRET=1); use the torch reference elsewhere"
    )


def _check_format(fmt_name: str) -> None:
    if not supports(fmt_name):
        raise ValueError(
            f"moewire.kernels: no kernel for wire format {fmt_name!r}; supported: "
            f"{', '.join(SUPPORTED_FORMATS)} (use formats.get(name).reference for the others)"
        )


def _amax_tensor(
    fmt_name: str, amax: torch.Tensor | float | None, device: torch.device
) -> torch.Tensor | None:
    """The FP32 ``[1]`` amax on ``device`` for the per-tensor formats, else ``None``."""
    if fmt_name not in _impl().NEEDS_AMAX:
        return None
    if amax is None:
        raise ValueError(
            f"moewire.kernels: format {fmt_name!r} needs an amax (its scale is global); pass "
            "the calibrated or constant FP32 amax tensor"
        )
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    if amax_t.numel() != 1:
        raise ValueError(
            f"moewire.kernels: amax must hold one element, got shape {tuple(amax_t.shape)}"
        )
    # A no-op for a device FP32 tensor; a host number is copied once (outside graphs).
    return amax_t.reshape(1).to(device)


def _check_blocks(what: str, hidden: int, fmt_name: str) -> None:
    """``hidden`` holds whole blocks of the format (the kernel's own block table)."""
    block = _impl().BLOCK_SIZES[fmt_name]
    if hidden % block:
        raise ValueError(
            f"{what}={hidden} is not a multiple of {fmt_name}'s block size {block}"
        )


def _triton_mod() -> ModuleType:
    import triton

    return triton


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__
