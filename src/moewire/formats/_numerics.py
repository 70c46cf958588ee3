"""Element casts, power-of-two helpers and constant divisors shared by the formats.

Plain torch, CPU and CUDA, with the same bits on both. Every helper takes and returns FP32
tensors (:func:`mul_recip` also float64) and is exact but for the one rounding it names
(round to nearest, ties to even, onto the element grid or onto FP32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0
# FP8 E4M3 FNUZ (``torch.float8_e4m3fnuz``, MI300's FP8): exponent bias 8, no infinity, no
# negative zero (0x80 is the one NaN), so its largest value is 1.875 * 2^7.
E4M3FNUZ_MAX = 240.0
E2M1_MAX = 6.0

# E2M1 magnitudes and the round-to-nearest-even decision points between them: a tie goes
# to the neighbour with an even mantissa (0, 1, 2, 4 have mantissa 0; 0.5, 1.5, 3, 6 have 1).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_UP_AT_TIE = (False, True, False, True, False, True, False)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def rcp_approx_bf16_decode_scale(ds: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32(ds)`` for ``ds = fl(a * fl(1/6))`` >= 2^-126, ``a`` BF16-valued FP32.

    The correctly rounded ``fl(1 / ds)`` moved by the measured offset of ``a``'s significand
    (``moewire.kernels.rcp_approx.UP_AT`` and ``DOWN_AT``), on the bits: ``1 / ds`` is a
    positive normal FP32 number, so one up or down in its bit pattern is one ulp (across a
    binade too). Python-scalar comparisons only: no constant tensor (CUDA-graph safe).
    """
    import torch

    # Imported here, not at the top: importing moewire.kernels imports torch, and this
    # module's import stays torch-free (`moewire formats` runs without torch).
    from moewire.kernels.rcp_approx import DOWN_AT, UP_AT

    m = (a.view(torch.int32) >> 16) & 0x7F
    offset = torch.zeros_like(m)
    for s in UP_AT:
        offset += (m == s).to(torch.int32)
    for s in DOWN_AT:
        offset -= (m == s).to(torch.int32)
    return (torch.reciprocal(ds).view(torch.int32) + offset).view(torch.float32)


def mul_recip(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` for a constant ``c``, written as torch computes it on CUDA: ``t * fl(1/c)``.

    PyTorch's CUDA division by a Python (CPU) scalar multiplies by the reciprocal rounded
    in the tensor's dtype (``a * (1 / b)``), while its CPU division is a true, correctly
    rounded division; the two differ by one ulp for many ``t`` (about half of all FP32
    values for ``c = 448``). The formats' sources (DeepGEMM's casts, ModelOpt's
    quantizers) run on CUDA, so the reciprocal form is the faithful one, and spelling it
    out gives the reference the same bits on CPU and CUDA.

    The reciprocal is ``fl(1/c)`` in ``t.dtype``, correctly rounded: Python's ``1.0 / c``
    is the correctly rounded double, and rounding that double once more to FP32 is still
    the correctly rounded FP32 quotient, since double rounding of a quotient through a
    format with ``p' >= 2p + 2`` bits is innocuous (Figueroa, 1995; 53 >= 2 * 24 + 2).
    ``tests/formats`` checks it against ``np.float32(1) / np.float32(c)`` for every divisor
    the formats use. It is a Python-side constant, so the helper traces under
    ``torch.compile`` and CUDA-graph capture.

    Args:
        t: FP32 or float64 tensor, any shape, any device.
        c: the divisor, a positive integer below 2^24 (exact in FP32): 448, 2688, 510.

    Returns:
        ``fl(t * fl(1/c))``: same shape, dtype and device as ``t``.

    Raises:
        TypeError: ``t`` is not FP32 or float64.
        ValueError: ``c`` is not a positive integer below 2^24.
    """
    import torch

    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"mul_recip: t must be float32 or float64, got {t.dtype}")
    if not (0 < c < 2**24 and c == int(c)):
        raise ValueError(
            f"mul_recip: the divisor {c!r} must be a positive integer below 2^24, exact in FP32"
        )
    # A 0-d CPU tensor of t's dtype: torch multiplies by its value as is on either device.
    return t * torch.tensor(1.0 / c, dtype=t.dtype)


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> nearest FP8 E4M3 ("fn") value, saturating, back in FP32.

    ``clamp(v, -448, 448)`` then RNE onto E4M3 (subnormals kept, step 2^-9). ±inf
    saturates to ±448, NaN stays NaN, -0.0 stays -0.0. The clamp comes first because
    torch's own cast of an out-of-range value differs between versions and devices.
    """
    import torch

    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def e4m3fnuz(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> nearest FP8 E4M3 FNUZ value (``float8_e4m3fnuz``), saturating, back in FP32.

    ``clamp(v, -240, 240)`` then RNE onto E4M3 FNUZ (normals 2^-7 .. 1.875 * 2^7,
    subnormal step 2^-10). The format has no negative zero: -0.0, and a negative value that
    rounds to zero, come back as +0.0. ±inf saturates to ±240, NaN stays NaN. The clamp
    comes first, as for :func:`e4m3`: torch's own cast maps what lies beyond 248 to NaN.
    """
    import torch

    return v.clamp(-E4M3FNUZ_MAX, E4M3FNUZ_MAX).to(torch.float8_e4m3fnuz).to(torch.float32)


def fp8_element(element: str) -> tuple[float, Callable[[torch.Tensor], torch.Tensor]]:
    """The largest value and the saturating RNE cast (FP32 -> FP32) of an FP8 element type
    (a row's ``element`` in ``moewire.format_table``): ``"e4m3"`` or ``"e4m3fnuz"``."""
    casts: dict[str, tuple[float, Callable[[torch.Tensor], torch.Tensor]]] = {
        "e4m3": (E4M3_MAX, e4m3),
        "e4m3fnuz": (E4M3FNUZ_MAX, e4m3fnuz),
    }
    if element not in casts:
        raise ValueError(
            f"an FP8 format's element must be 'e4m3' or 'e4m3fnuz', got {element!r}; fix its "
            "row in moewire.format_table"
        )
    return casts[element]


def e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """|v| (FP32, >= 0 or NaN) -> nearest FP4 E2M1 magnitude, saturating at 6, RNE.

    Rounds ``a`` onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}: a <= 0.25 -> 0, < 0.75 -> 0.5,
    <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6 (inf too).
    NaN stays NaN.
    """
    import torch

    idx = torch.zeros(a.shape, dtype=torch.int64, device=a.device)
    for mid, up_at_tie in zip(_E2M1_MIDPOINTS, _E2M1_UP_AT_TIE, strict=True):
        idx += (a >= mid) if up_at_tie else (a > mid)
    values = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=a.device)
    return torch.where(torch.isnan(a), a, values[idx])


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2(v))`` (int32) of positive finite FP32 values, subnormals included.

    Read from the binary exponent (``frexp``), never from a rounded ``log2``: a value just
    below a power of two must not round up to it. Other inputs give an unspecified value.
    """
    import torch

    _, exponent = torch.frexp(v)
    return exponent - 1


def pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0 ** k`` as FP32, exactly, for int32 ``k`` in [-149, 127] (subnormals included)."""
    import torch

    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def exponent_fields(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Biased exponent and mantissa-is-nonzero of FP32 ``v >= 0`` (int32 each): their sum
    is the exponent field of the smallest power of two >= ``v`` (before any clamp)."""
    import torch

    bits = v.view(torch.int32)
    return (bits >> 23) & 0xFF, ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ceil_pow2_ue8m0(v: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's ``ceil_to_ue8m0``: the smallest power of two >= |v|, as FP32.

    From the bits of ``|v|``: biased exponent ``e`` plus one when the mantissa is non-zero,
    clamped to [1, 254], i.e. ``2^clamp(ceil(log2|v|), -126, 127)``. So +inf and NaN map
    to 2^127 (biased exponent 255 clamped to 254), and 0 maps to 2^-126.
    """
    import torch

    biased, inexact = exponent_fields(v.abs())
    return ((biased + inexact).clamp(1, 254) << 23).view(torch.float32)


def split_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[..., H]`` -> FP32 ``[..., H // block, block]`` (may be a view of ``x``: read only)."""
    import torch

    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
