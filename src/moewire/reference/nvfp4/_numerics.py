"""Casts of the stand-in NVFP4 Mega-MoE kernel, and the FP32 fused multiply-add of its combine.

Written from the sources, independently of ``moewire.formats`` (the reference is what the
quantization code is tested against): vLLM's staging kernel
``model_executor/layers/fused_moe/prepare_megamoe.py::_prepare_megamoe_nvfp4_inputs_kernel``
(0.33 and 0.34 compute the same values), DeepGEMM's ``utils/nvfp4.py::per_token_cast_to_nvfp4``
and the kernel ``include/deep_gemm/impls/sm100_nvfp4_mega_moe.cuh`` (vLLM 0.34's bundled
DeepGEMM: the routed L2-input cast ~l.1430-1460, the shared one via
``common/math.cuh::get_ue8m0_sf_exp``, the combine ~l.1746-1807).

Conventions:

- NVFP4: E2M1 codes packed two per byte (element ``2j`` in the low nibble, as
  :func:`moewire.reference._numerics.pack_fp4`), one E4M3 scale per 16 elements, four
  scale bytes per int32 (byte ``j`` of int ``i`` scales 16-element block ``4i + j``).
- ``fl(.)`` is one FP32 rounding (nearest even).

May import: torch and ``moewire.reference._numerics`` only (nothing else of the family).
"""

from __future__ import annotations

import torch

from moewire.reference._numerics import FP4_MAX, FP8_MAX, decode_e2m1, quantize_e2m1

NVFP4_BLOCK = 16
# The smallest positive E4M3 value; block scales are clamped to [2^-9, 448].
E4M3_MIN = 2.0**-9
# E2M1 max times E4M3 max: the per-token scale maps a row's amax to 6 * 448.
NVFP4_RANGE = FP4_MAX * FP8_MAX
# vLLM's staging floor on a token's amax.
TOKEN_AMAX_FLOOR = 1e-12


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> nearest E4M3 value (RNE, saturating at ±448), back in FP32."""
    return v.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def pack_e4m3(scales: torch.Tensor) -> torch.Tensor:
    """E4M3-exact FP32 scales ``[..., G]`` -> int32 ``[..., G / 4]`` (four bytes per int)."""
    return scales.to(torch.float8_e4m3fn).contiguous().view(torch.uint8).view(torch.int32)


def unpack_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., G / 4]`` -> FP32 scales ``[..., G]``."""
    return packed.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).float()


def unpack_fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """FP32 ``[..., 2C]`` E2M1 values of packed int8/uint8 ``[..., C]``."""
    b = packed.contiguous().view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    return decode_e2m1(codes)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 ``[..., K]`` -> int8 ``[..., K / 2]``."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def dequantize_nvfp4(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """FP32 ``[..., N, K]`` = E2M1 element times its E4M3 block scale (exact).

    Args:
        packed: int8/uint8 ``[..., N, K / 2]``.
        sf: int32 ``[..., N, K / 64]``, four E4M3 bytes per int (any strides).
    """
    values = unpack_fp4_values(packed)
    scales = unpack_e4m3(sf)
    groups = values.unflatten(-1, (scales.shape[-1], NVFP4_BLOCK))
    return (groups * scales.unsqueeze(-1)).flatten(-2)


def stage_nvfp4_per_token(
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's NVFP4 dispatch staging (``kNvfp4DynamicToken``) of ``[T, H]`` tokens.

    Per token, FP32: ``x_scale = fl(max(max|x|, 1e-12) * fl(1/2688))``; ``v = fl(x /
    x_scale)`` (``tl.div_rn``); per 16: ``bs = e4m3(clamp(fl(max|v| * fl(1/6)), 2^-9,
    448))``; ``code = e2m1(fl(v / bs))`` (round to nearest even on {0, 0.5, .., 6},
    saturating). Dequantized: ``e2m1 * bs * x_scale``.

    Returns:
        ``(x, x_sf, x_scales)``: int8 ``[T, H/2]``, int32 ``[T, H/64]``, FP32 ``[T]``.
    """
    h = hidden.float()
    amax = h.abs().amax(dim=-1, keepdim=True) if h.shape[-1] else h.new_zeros(h.shape[0], 1)
    x_scale = amax.clamp(min=TOKEN_AMAX_FLOOR) * torch.tensor(1.0 / NVFP4_RANGE)
    values = (h / x_scale).unflatten(-1, (-1, NVFP4_BLOCK))
    bmax = values.abs().amax(dim=-1, keepdim=True)
    bs = e4m3((bmax * torch.tensor(1.0 / FP4_MAX)).clamp(E4M3_MIN, FP8_MAX))
    codes = quantize_e2m1(values / bs).flatten(-2)
    return pack_fp4_codes(codes), pack_e4m3(bs.squeeze(-1)), x_scale.squeeze(-1)


def quantize_nvfp4_l2_input(
    h: torch.Tensor, l2_activation_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's cast of a routed expert's (unweighted) SwiGLU output to NVFP4.

    ``s = l2_activation_scale``; per 16 channels: ``d = fl(6 s)``, ``a = min(max|h|, fl(448
    d))``, ``bs = e4m3(clamp(fl(a / d), 2^-9, 448))`` (the kernel's FMA-corrected division
    is IEEE division on that range), ``code = e2m1(fl(h * fl(1 / fl(bs * s))))``. The L2
    GEMM reads ``e2m1 * bs``; ``s`` belongs in ``l2_alpha``.

    Args:
        h: FP32 ``[N, I]``.
        l2_activation_scale: the positive global scale.

    Returns:
        ``(codes, bs)``: E2M1 codes uint8 ``[N, I]`` and the E4M3 block scales FP32
        ``[N, I/16]``.
    """
    s = torch.tensor(l2_activation_scale, dtype=torch.float32)
    d = s * 6.0
    cap = d * FP8_MAX
    groups = h.float().unflatten(-1, (-1, NVFP4_BLOCK))
    amax = torch.minimum(groups.abs().amax(dim=-1, keepdim=True), cap)
    bs = e4m3((amax / d).clamp(E4M3_MIN, FP8_MAX))
    inv = 1.0 / (bs * s)
    return quantize_e2m1(groups * inv).flatten(-2), bs.squeeze(-1)


def ue8m0_for_e4m3(amax: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's ``get_ue8m0_sf_exp<e4m3>`` as an FP32 power of two.

    The smallest power of two ``sf`` with ``amax / sf <= 448`` (exponent carry when the
    mantissa of ``amax`` exceeds 1.75's), floored at ``2^-22`` (the staging's ``1e-4``).
    """
    bits = amax.float().contiguous().view(torch.int32)
    rounded = (bits + (0x7FFFFF - 0x600000)) >> 23
    exponent = rounded.clamp(min=105 + 8) - 8
    return (exponent << 23).view(torch.float32)


def quantize_mxfp8_l2_input(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's cast of a shared expert's SwiGLU output to E4M3 with UE8M0 per 32.

    Returns:
        ``(q, sf)``: FP8 E4M3 ``[N, I]`` and FP32 power-of-two scales ``[N, I/32]``.
    """
    groups = h.float().unflatten(-1, (-1, 32))
    sf = ue8m0_for_e4m3(groups.abs().amax(dim=-1))
    q = (groups * (1.0 / sf).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), sf


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl(a * b + c)`` with one rounding (CUDA's ``__fmaf_rn``), for FP32 tensors.

    ``a * b`` of two FP32 values is exact in float64 (48 significant bits); the float64 sum
    is made round-to-odd from its exact error term (TwoSum), and rounding a round-to-odd
    float64 to FP32 is the correctly rounded result (53 >= 2 * 24 + 2; Boldo and
    Melquiond, 2008). Non-finite results are passed through from the float64 sum.

    Args:
        a, b, c: FP32 tensors, broadcastable to one shape.

    Returns:
        FP32, the broadcast shape.
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - c64
    err = (c64 - (s - bb)) + (p - bb)
    even = (s.view(torch.int64) & 1) == 0
    inf = torch.full_like(s, float("inf"))
    toward = torch.where(err > 0, inf, -inf)
    odd = torch.where((err != 0) & even & torch.isfinite(s), torch.nextafter(s, toward), s)
    return odd.float()
