"""The stand-in kernel's own casts: UE8M0 scales, FP8 E4M3 staging, FP4 E2M1 weights.

Written independently of ``moewire.formats`` on purpose: the reference kernel is what the
quantization code is tested against, so it must not share its arithmetic.

Conventions (DeepGEMM's):

- A UE8M0 scale is a power of two stored as its 8 exponent bits. In FP32 form it is the
  float whose exponent field is that byte and whose mantissa is zero.
- Packed UE8M0: four scale bytes per int32, little-endian, so byte ``j`` of int ``i`` is
  the scale of 32-element group ``4 * i + j``.
- Packed FP4: two E2M1 codes per byte, element ``2 * i`` in the low nibble and ``2 * i + 1``
  in the high nibble. A code is ``sign << 3 | index`` into ``E2M1_VALUES``.

May import: torch only (nothing of moewire).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive E2M1 magnitudes. Round to nearest even: a tie goes to the
# neighbour with an even mantissa, down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_GOES_UP = (False, True, False, True, False, True, False)


def ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    """The exponent field of the smallest power of two >= FP32 ``x >= 0``, not clamped
    (int32): the biased exponent of ``x``, plus one when its mantissa is non-zero."""
    bits = x.view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive FP32 values up to a power of two, as UE8M0 scales.

    ``2^ceil(log2(x))`` computed on the bits (exact), with the exponent field clamped to
    ``[1, 254]`` so that a zero input gives ``2^-126`` rather than zero (DeepGEMM's rule).

    Args:
        x: FP32 tensor of non-negative values.

    Returns:
        FP32 tensor of powers of two, same shape.
    """
    exponent = ceil_exponent(x.float().abs().contiguous())
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Pack FP32 power-of-two scales ``[..., G]`` into int32 ``[..., G / 4]``."""
    exponent = (sf.float().contiguous().view(torch.int32) >> 23).to(torch.uint8)
    return exponent.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 ``[..., G / 4]`` into FP32 power-of-two scales ``[..., G]``."""
    exponent = packed.contiguous().view(torch.uint8).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def cast_to_fp8_ue8m0(
    x: torch.Tensor, gran: int = 32, amax_floor: float | None = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one UE8M0 scale per ``gran`` elements along the last dim.

    Per group: ``amax = max|x|`` (clamped to ``>= amax_floor`` when given), ``sf =
    ceil_to_ue8m0(amax / 448)`` (FP32 division), ``q = e4m3(x * (1 / sf))``. ``1 / sf`` is an
    exact power of two, so the only rounding is the E4M3 cast (round to nearest even).

    Args:
        x: ``[..., K]`` floating tensor, ``K % gran == 0``.
        gran: group size along the last dim.
        amax_floor: lower clamp of the group amax (dispatch staging uses 1e-4; the kernel's
            re-quantization of ``h`` uses none).

    Returns:
        ``(q, sf)``: FP8 E4M3 ``[..., K]`` and FP32 scales ``[..., K / gran]``.
    """
    groups = x.float().unflatten(-1, (-1, gran))
    amax = groups.abs().amax(dim=-1)
    if amax_floor is not None:
        amax = amax.clamp(min=amax_floor)
    sf = ceil_to_ue8m0(amax / FP8_MAX)
    q = (groups * (1.0 / sf).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.flatten(-2), sf


def scale_groups(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """``q.float() * sf`` with ``sf`` FP32 ``[..., K / g]`` broadcast over groups of ``g``."""
    groups = q.float().unflatten(-1, (sf.shape[-1], -1))
    return (groups * sf.unsqueeze(-1)).flatten(-2)


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, ``sign << 3 | index``) of FP32 values, round to nearest even.

    Magnitudes above 6 saturate to 6. ``-0`` and values that round to zero get code 0; NaN
    gets index 7 (every comparison below counts it).

    ``index`` is the number of midpoints ``m`` that ``|x|`` passes: ``|x| > m`` where a tie
    goes down, ``|x| >= m`` where it goes up. Written as comparisons with Python scalars, so
    it allocates no constant tensor (safe inside CUDA-graph capture).
    """
    a = x.float().abs()
    index = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for m, tie_goes_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_GOES_UP, strict=True):
        passed = ~(a < m) if tie_goes_up else ~(a <= m)
        index += passed.to(torch.uint8)
    negative = (x < 0) & (index != 0)
    return index | (negative.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of E2M1 codes (any integer dtype, low 4 bits used).

    Index ``i`` is ``i / 2`` below 4 and ``2^(i // 2 - 1) * (1 + (i & 1) / 2)`` from 4 on
    (0, 0.5, 1, 1.5, 2, 3, 4, 6): exact arithmetic, no table to copy to the device."""
    c = codes.to(torch.int32) & 0xF
    i = (c & 0x7).float()
    low = i * 0.5
    high = torch.exp2(torch.floor(i * 0.5) - 1.0) * (1.0 + (c & 1).float() * 0.5)
    magnitude = torch.where(i < 4, low, high)
    return torch.where((c & 0x8) != 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., K]`` two per byte into int8 ``[..., K / 2]``."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int8/uint8 ``[..., K / 2]`` into E2M1 codes uint8 ``[..., K]``."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def quantize_fp4_ue8m0(w: torch.Tensor, gran: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 E2M1 weights with one UE8M0 scale per ``gran`` along the last dim (K).

    Per group: ``sf = ceil_to_ue8m0(max(amax, 1e-4) / 6)``, ``code = e2m1(w / sf)``.

    Args:
        w: ``[..., N, K]`` floating tensor, ``K % 128 == 0``.

    Returns:
        ``(packed, sf)``: int8 ``[..., N, K / 2]`` and packed UE8M0 int32 ``[..., N, K / 128]``.
    """
    groups = w.float().unflatten(-1, (-1, gran))
    sf = ceil_to_ue8m0(groups.abs().amax(dim=-1).clamp(min=1e-4) / FP4_MAX)
    codes = quantize_e2m1(groups * (1.0 / sf).unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), pack_ue8m0(sf)


def _fp4_byte_table(device: torch.device) -> torch.Tensor:
    """FP32 ``[256, 2]``: the two E2M1 values (low nibble first) of every packed byte."""
    codes = torch.arange(256, dtype=torch.int32)
    return torch.stack([decode_e2m1(codes & 0xF), decode_e2m1(codes >> 4)], dim=1).to(device)


def dequantize_weight(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """FP32 values of a quantized weight ``[..., N, K]`` with packed UE8M0 per 32 along K.

    ``w`` is either packed FP4 (int8/uint8 ``[..., N, K / 2]``) or FP8 E4M3 ``[..., N, K]``;
    ``sf`` is int32 ``[..., N, K / 128]``. Every value is ``element * 2^e``: exact in FP32
    (and in BF16), so products with FP8 activations are exact in FP32.
    """
    if w.dtype == torch.float8_e4m3fn:
        elements = w.float()
    else:
        # One gather per byte (two values) is several times faster than unpacking nibbles.
        table = _fp4_byte_table(w.device)
        pairs = torch.nn.functional.embedding(w.contiguous().view(torch.uint8).int(), table)
        elements = pairs.flatten(-2)
    return scale_groups(elements, unpack_ue8m0(sf))


# DeepGEMM's FP8 combine tiles a row by 128 columns, one UE8M0 byte each.
FP8_COMBINE_GRAN = 128


def fp8_combine_encode(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's ``DG_USE_FP8_COMBINE`` L2 epilogue: BF16 rows to FP8 bytes and UE8M0 bytes.

    Per 128-column tile (``impls/sm100_fp8_fp4_mega_moe.cuh``, sgl-deep-gemm 0.2.5): ``amax``
    over the tile, ``e = fast_log2_ceil(amax * (1.0f / 448.0f))`` (``exponent - 127 +
    (mantissa != 0)`` on the bits, ``common/math.cuh``), the FP8 byte of ``x * 2^-e``
    (``__nv_fp8x4_e4m3``: round to nearest even, saturating) and the scale byte ``e + 127``.

    Args:
        rows: BF16 ``[..., H]``, H a multiple of 128.

    Returns:
        ``(q, sf)``: FP8 E4M3 ``[..., H]`` and uint8 ``[..., H / 128]``.
    """
    x = rows.float().reshape(*rows.shape[:-1], -1, FP8_COMBINE_GRAN)
    s = x.abs().amax(-1, keepdim=True) * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    e = ceil_exponent(s) - 127
    inv = ((127 - e) << 23).view(torch.float32)  # fast_pow2(-e)
    q = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(rows.shape)
    return q, (e + 127).to(torch.uint8).squeeze(-1)


def fp8_combine_decode(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """The combine reduce's FP32 values of FP8 rows: ``float(q) * fast_pow2(byte - 127)``
    (byte 0 gives the bit pattern 0, i.e. a scale of 0.0). FP32 ``[..., H]``."""
    scale = (sf.to(torch.int32) << 23).view(torch.float32)
    x = q.float().reshape(*q.shape[:-1], -1, FP8_COMBINE_GRAN)
    return (x * scale.unsqueeze(-1)).reshape(q.shape)

