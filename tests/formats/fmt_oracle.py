"""Independent oracles for every wire format: NumPy FP32/float64 math and ml_dtypes casts.

Written from the math in docs/formats.md, not from moewire's torch code: element rounding
comes from ml_dtypes (float8_e4m3fn, float8_e4m3fnuz, float4_e2m1fn, bfloat16), powers of two from
``np.frexp`` and are checked against float8_e8m0fnu, FP32 arithmetic is NumPy float32
(IEEE, one rounding per operation), and LogFMT is evaluated in float64. A division of a
tensor by a constant ``c`` is the reciprocal form torch computes on CUDA, ``t * fl(1/c)``,
with the reciprocal formed here as one NumPy division in the tensor's precision
(:func:`recip32`, :func:`recip64`).

Every oracle takes a float32 NumPy array (the input values, exactly) and returns a
float32 array: the result before the final cast to the input dtype.
"""

from __future__ import annotations

import functools
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from bitexact import assert_same_bits

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E4M3FNUZ = ml_dtypes.float8_e4m3fnuz
E2M1 = ml_dtypes.float4_e2m1fn
E8M0 = ml_dtypes.float8_e8m0fnu

_NP_OF = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16, torch.float32: np.float32}


def recip32(c: float) -> np.float32:
    """fl32(1/c): one FP32 division (no double intermediate)."""
    return F32(1.0) / F32(c)


def recip64(c: float) -> np.float64:
    """fl64(1/c): one float64 division."""
    return np.float64(1.0) / np.float64(c)


def e4m3(v: np.ndarray) -> np.ndarray:
    """Saturating RNE onto E4M3 (ml_dtypes), NaN kept; float64 result."""
    return np.clip(v, -448.0, 448.0).astype(E4M3).astype(np.float64)


def e4m3fnuz(v: np.ndarray) -> np.ndarray:
    """Saturating RNE onto E4M3 FNUZ (ml_dtypes; max 240, no -0), NaN kept; float64."""
    return np.clip(v, -240.0, 240.0).astype(E4M3FNUZ).astype(np.float64)


def e2m1(v: np.ndarray) -> np.ndarray:
    """Saturating RNE onto E2M1 (ml_dtypes) with the sign kept; NaN kept; float64 result."""
    nan = np.isnan(v)
    q = np.clip(np.where(nan, 0.0, v), -6.0, 6.0).astype(E2M1).astype(np.float64)
    return np.where(nan, np.nan, q)


def exact_pow2(k: np.ndarray) -> np.ndarray:
    """2**k in float64, checked to be a UE8M0 value (ml_dtypes float8_e8m0fnu round trip)."""
    p = np.ldexp(1.0, k.astype(np.int64))
    assert np.array_equal(p.astype(E8M0).astype(np.float64), p), "scale is not a UE8M0 value"
    return p


def _blocks(x: np.ndarray, b: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)


def bf16(x: np.ndarray, amax=None) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(F32)


def _fp8_per_tensor(fp8_max: float, element):
    def oracle(x: np.ndarray, amax) -> np.ndarray:
        amax = F32(amax)
        safe = amax if amax > F32(2.0**-24) else F32(1.0)
        s = F32(fp8_max) * (F32(1.0) / safe)
        q = element(x * s).astype(F32)
        return q * (F32(1.0) / s)

    return oracle


fp8 = _fp8_per_tensor(448.0, e4m3)


def _ceil_ue8m0(sf: np.ndarray) -> np.ndarray:
    """DeepGEMM's UE8M0 rounding of a positive scale, from frexp: 2^ceil(log2 sf)."""
    finite = np.isfinite(sf)
    m, e = np.frexp(np.where(finite, sf, 1.0).astype(np.float64))
    k = np.where(m == 0.5, e - 1, e)
    k = np.where(finite, np.clip(k, -126, 127), 127)  # DeepGEMM clamps the biased exponent
    return exact_pow2(k).astype(F32)


def fp8_block(block: int, ue8m0: bool):
    def oracle(x: np.ndarray, amax=None) -> np.ndarray:
        xb = _blocks(x, block)
        a = np.max(np.abs(xb), axis=-1, keepdims=True)
        a = np.where(np.isnan(a), a, np.maximum(a, F32(1e-4)))
        sf = (a * recip32(448.0)).astype(F32)
        if ue8m0:
            sf = _ceil_ue8m0(sf)
        q = e4m3(xb * (F32(1.0) / sf)).astype(F32)
        return (q * sf).reshape(x.shape)

    return oracle


def mx(emax: int, element):
    def oracle(x: np.ndarray, amax=None) -> np.ndarray:
        xb = _blocks(x, 32).astype(np.float64)
        a = np.max(np.abs(xb), axis=-1, keepdims=True)
        finite = np.isfinite(a)
        _, e = np.frexp(np.where(finite & (a > 0), a, 1.0))
        k = np.maximum(e - 1 - emax, -127)
        scale = exact_pow2(k)
        out = element(xb / scale) * scale
        out = np.where(finite, out, np.nan)
        return out.astype(F32).reshape(x.shape)

    return oracle


def _torch_sign(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, F32(1), np.where(v < 0, F32(-1), np.where(np.isnan(v), v, F32(0))))


def _nvfp4(x: np.ndarray, gs: np.ndarray) -> np.ndarray:
    xb = _blocks(x, 16)
    bmax = np.max(np.abs(xb), axis=-1, keepdims=True)
    t = np.minimum(bmax / (F32(6.0) * gs), F32(448.0))
    bs = e4m3(t).astype(F32) * gs
    bs = np.where(bs < F32(1e-5), F32(1.0), bs)
    q = e2m1(np.abs(xb) / bs).astype(F32)
    return ((_torch_sign(xb) * q) * bs).reshape(x.shape)


def nvfp4(x: np.ndarray, amax) -> np.ndarray:
    amax = F32(amax)
    gs = amax * recip32(2688.0)
    gs = gs if gs > 0 else F32(1e-12)  # also where a subnormal amax's product underflows
    return _nvfp4(x, np.asarray(gs, dtype=F32))


def nvfp4_token(x: np.ndarray, amax=None) -> np.ndarray:
    row = np.max(np.abs(x), axis=-1, keepdims=True)[..., None]
    gs = (row * recip32(2688.0)).astype(F32)
    gs = np.where(gs == 0, F32(1e-12), gs).astype(F32)
    return _nvfp4(x, gs)


def logfmt10(x: np.ndarray, amax=None) -> np.ndarray:
    """DeepEP LogFMT-10 in float64, per 128 channels, cast decided per 512/1024 channels."""
    v = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    hidden = v.shape[-1]
    rows = v.reshape(-1, hidden)
    negative = np.signbit(x).reshape(-1, hidden)
    group = 1024 if hidden % 1024 == 0 else 512
    out = np.empty_like(rows)
    with np.errstate(divide="ignore", invalid="ignore"):
        for r, row in enumerate(rows):
            for g0 in range(0, hidden, group):
                chunk = row[g0 : g0 + group].reshape(-1, 128)
                a = np.abs(chunk)
                amax = np.nanmax(np.where(np.isnan(a), 0.0, a), axis=1, keepdims=True)
                amin = np.min(np.where(np.isnan(a), np.inf, a), axis=1, keepdims=True)
                la = np.log2(amax)
                li = np.maximum(np.log2(amin), la - 32.0)
                if not np.all((la < 0) & (li < la)):
                    out[r, g0 : g0 + group] = chunk.reshape(-1)
                    continue
                step = (la - li) * recip64(510.0)
                step_inv = 1.0 / step
                fused = (2.0 - np.log2((1.0 + np.exp2(step)) * 0.5) * step_inv) - li * step_inv
                t = np.log2(a) * step_inv + fused
                code = np.floor(np.where(np.isnan(t) | (t < 0), 0.0, t))
                assert code.max() <= 511
                dec = np.where(code == 0, 0.0, np.exp2((code - 1.0) * step + li))
                sign = np.where(negative[r, g0 : g0 + group], -1.0, 1.0).reshape(dec.shape)
                out[r, g0 : g0 + group] = (sign * dec).reshape(-1)
    return out.reshape(v.shape).astype(F32)


def _ceil_log2(v: np.ndarray) -> np.ndarray:
    """ceil(log2 v) of positive values (float64 frexp: v = m * 2^k, m in [0.5, 1)); +inf gives
    128, above every FP32 exponent, so a caller's clip saturates it as ``satfinite`` does
    (frexp alone would read inf as exponent 0)."""
    m, k = np.frexp(np.where(v > 0, v, 1.0).astype(np.float64))
    return np.where(np.isposinf(v), 128, np.where(m == 0.5, k - 1, k)).astype(np.int64)


def _block_amax(x: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xb = _blocks(x, b)
    a = np.max(np.abs(xb), axis=-1, keepdims=True)
    finite = np.isfinite(a)
    return xb, np.where(finite, a, F32(0)).astype(F32), finite


def deepgemm_fp8_combine(x: np.ndarray, amax=None) -> np.ndarray:
    """DeepGEMM DG_USE_FP8_COMBINE: e = ceil(log2(amax/448)) (>= -126; -127 and a zero
    dequantization scale when amax/448 is 0), E4M3 of x * 2^-e."""
    xb, a, finite = _block_amax(x, 128)
    s = (a * recip32(448.0)).astype(F32)
    e = np.where(s == 0, -127, np.maximum(_ceil_log2(s), -126))
    q = e4m3(xb.astype(np.float64) * np.ldexp(1.0, -e))
    sf = np.where(e == -127, 0.0, exact_pow2(e))
    out = np.where(finite, q * sf, np.nan)
    return out.astype(F32).reshape(x.shape)


def trtllm_32e4m3xe8m0(x: np.ndarray, amax=None) -> np.ndarray:
    """TRT-LLM host oracle: e = clip(ceil(log2(max(amax, 1e-30) / 448)), -127, 127), -127
    for a zero block; E4M3 of x / 2^e."""
    xb, a, finite = _block_amax(x, 32)
    s = (np.maximum(a, F32(1e-30)) * recip32(448.0)).astype(F32)
    e = np.where(a == 0, -127, np.clip(_ceil_log2(s), -127, 127))
    scale = exact_pow2(e)
    out = np.where(finite, e4m3(xb.astype(np.float64) / scale) * scale, np.nan)
    return out.astype(F32).reshape(x.shape)


def te_mxfp8(x: np.ndarray, amax=None) -> np.ndarray:
    """TE float_to_e8m0: round amax/448 up to a power of two 2^-127 .. 2^127 (byte 0 for
    0); exp2f_rcp quantizes byte 0 with 1."""
    xb, a, finite = _block_amax(x, 32)
    v = (a * recip32(448.0)).astype(F32)
    byte = np.where(v == 0, 0, np.clip(np.maximum(_ceil_log2(v), -127) + 127, 0, 254))
    recip = np.where(byte == 0, F32(1), np.ldexp(F32(1), 127 - byte).astype(F32))
    q = e4m3((xb * recip).astype(F32))
    out = np.where(finite, q * exact_pow2(byte - 127), np.nan)
    return out.astype(F32).reshape(x.shape)


def trtllm_16e2m1xbf16(x: np.ndarray, amax=None) -> np.ndarray:
    """TRT-LLM host oracle: BF16 block amax, decode scale amax * fl(1/6), encode with its
    reciprocal, E2M1 nearest-even (zeros +0), decode q * scale in FP32."""
    xb, a, finite = _block_amax(x, 16)
    ds = (a.astype(ml_dtypes.bfloat16).astype(F32) * recip32(6.0)).astype(F32)
    with np.errstate(divide="ignore"):
        # A subnormal decode scale is flushed (the encoder's rcp.approx.ftz): zeros.
        enc = np.where(ds >= np.finfo(F32).tiny, F32(1) / ds, F32(0)).astype(F32)
    v = (xb * enc).astype(F32)
    q = e2m1(v)
    q = np.where(q == 0, 0.0, q)
    out = np.where(finite, (q.astype(F32) * ds).astype(F32), np.nan)
    return out.astype(F32).reshape(x.shape)


_FP32_MAX = np.finfo(F32).max
_TINY = np.finfo(F32).tiny
_MASK = F32(1e30)  # cutlass.Float32(1e30)


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(F32)


def _rcp_ftz(v: np.ndarray) -> np.ndarray:
    """rcp.approx.ftz.f32 as the correctly rounded reciprocal (an FP32 division); a
    subnormal input is flushed to 0 and its reciprocal +inf; min(., FLT_MAX) as the
    encoders cap it. Exact on powers of two (``tests/kernels/test_gpu.py``)."""
    with np.errstate(divide="ignore"):
        r = np.where(v < _TINY, np.inf, F32(1) / np.where(v < _TINY, F32(1), v))
    return np.minimum(r.astype(F32), _FP32_MAX)


RCP_DUMP = (Path(__file__).resolve().parents[2] / "benchmarks/results/rcp-approx"
            / "rcp_approx_bf16_amax.npz")


@functools.cache
def _measured_rcp() -> tuple[np.ndarray, np.ndarray]:
    """``(ds_bits, rcp_bits)`` sorted by ``ds_bits``: what ``rcp.approx.ftz.f32`` gave on the
    GPU for the decode scale of every positive normal BF16 amax (the committed measurement
    of ``benchmarks/rcp_approx_table.py``)."""
    dump = np.load(RCP_DUMP)
    order = np.argsort(dump["ds_bits"])
    return dump["ds_bits"][order], dump["rcp_bits"][order]


def _rcp_measured(ds: np.ndarray) -> np.ndarray:
    """The device's ``rcp.approx.ftz.f32`` of NVFP4 decode scales of BF16 amaxes, read from
    the measurement (a value it does not hold: the correctly rounded reciprocal, as
    :func:`_rcp_ftz`)."""
    keys, values = _measured_rcp()
    bits = np.ascontiguousarray(ds, dtype=F32).view(np.int32)
    at = np.clip(np.searchsorted(keys, bits), 0, len(keys) - 1)
    found = (keys[at] == bits) & (ds >= _TINY)
    return np.where(found, values[at].view(F32), _rcp_ftz(ds)).astype(F32)


def _flashinfer_enc(scale: np.ndarray, rcp=_rcp_ftz) -> np.ndarray:
    """FlashInfer's _enc_mxfp8 / _enc_nvfp4: fmin(rcp, FLT_MAX) * fmin(scale * 1e30, 1)."""
    mask = np.minimum((scale * _MASK).astype(F32), F32(1))
    return (rcp(scale) * mask).astype(F32)


def flashinfer_mxfp8(x: np.ndarray, amax=None) -> np.ndarray:
    """FlashInfer 32e4m3xe8m0: BF16 amax, cvt.rp to UE8M0 of amax * fl(1/448) (frexp),
    the masked reciprocal (the subnormal 2^-127 flushed by rcp.approx.ftz), E4M3."""
    xb, a, finite = _block_amax(x, 32)
    c = (_bf16(a) * recip32(448.0)).astype(F32)
    byte = np.where(c == 0, 0, np.clip(_ceil_log2(c) + 127, 0, 254))
    sf = exact_pow2(byte - 127).astype(F32)
    enc = _flashinfer_enc(sf)
    q = e4m3((xb * enc).astype(F32))
    out = np.where(finite, q * sf, np.nan)
    return out.astype(F32).reshape(x.shape)


def flashinfer_nvfp4(x: np.ndarray, amax=None) -> np.ndarray:
    """FlashInfer 16e2m1xbf16: BF16 amax, ds = amax * fl(1/6), the masked reciprocal (the
    GPU's rcp.approx.ftz.f32, as measured), E2M1 with the sign kept (ml_dtypes), decode
    q * ds in FP32."""
    xb, a, finite = _block_amax(x, 16)
    ds = (_bf16(a) * recip32(6.0)).astype(F32)
    enc = _flashinfer_enc(ds, _rcp_measured)
    q = e2m1((xb * enc).astype(F32))
    out = np.where(finite, (q.astype(F32) * ds).astype(F32), np.nan)
    return out.astype(F32).reshape(x.shape)


def _mori_blockwise(fp8_max: float, element):
    """MoRI fp8_blockwise: per 128, a block whose BF16 amax exceeds the FP8 max is scaled by
    fl(M / a) (sent scale fl(a * fl(1/M))); the others are cast as they are."""
    m = F32(fp8_max)

    def oracle(x: np.ndarray, amax=None) -> np.ndarray:
        xb, a, finite = _block_amax(x, 128)
        a = _bf16(a)
        scaled = a > m
        inv = np.where(scaled, m / np.where(scaled, a, F32(1)), F32(1)).astype(F32)
        s = np.where(scaled, (a * recip32(fp8_max)).astype(F32), F32(1))
        q = element(np.clip((xb * inv).astype(F32), -m, m)).astype(F32)
        out = np.where(finite, (q * s).astype(F32), np.nan)
        return out.astype(F32).reshape(x.shape)

    return oracle


def _mori_direct_cast(element):
    """MoRI fp8_direct_cast: SATFINITE RNE of each element; ±inf and NaN become NaN."""
    def oracle(x: np.ndarray, amax=None) -> np.ndarray:
        return np.where(np.isinf(x), np.nan, element(x)).astype(F32)

    return oracle


def flydsl_fp8_blockwise_1x32(x: np.ndarray, amax=None) -> np.ndarray:
    """FlyDSL fp8_blockwise_1x32 (32-column blocks): e = ceil(log2(amax * fl(1/448))), at
    least -126 (a subnormal product); a product of 0 quantizes with 2^-127 (E8M0 byte 0)
    and decodes with 0.0. E4M3 of x / 2^e, decoded q * 2^e."""
    xb, a, finite = _block_amax(x, 32)
    w = (a * recip32(448.0)).astype(F32)
    e = np.where(w == 0, -127, np.maximum(_ceil_log2(w), -126))
    scale = exact_pow2(e)
    q = e4m3(xb.astype(np.float64) / scale)
    out = np.where(finite, q * np.where(w == 0, 0.0, scale), np.nan)
    return out.astype(F32).reshape(x.shape)


ORACLES = {
    "bf16": bf16,
    "fp8": fp8,
    "fp8_b128": fp8_block(128, ue8m0=False),
    "fp8_b128_ue8m0": fp8_block(128, ue8m0=True),
    "fp8_b32_ue8m0": fp8_block(32, ue8m0=True),
    "mxfp8": mx(8, e4m3),
    "mxfp4": mx(2, e2m1),
    "nvfp4": nvfp4,
    "nvfp4_token": nvfp4_token,
    "logfmt10": logfmt10,
    "deepgemm_fp8_combine": deepgemm_fp8_combine,
    "trtllm_32e4m3xe8m0": trtllm_32e4m3xe8m0,
    "te_mxfp8": te_mxfp8,
    "trtllm_16e2m1xbf16": trtllm_16e2m1xbf16,
    "fp8_e4m3fnuz": _fp8_per_tensor(240.0, e4m3fnuz),
    "flashinfer_mxfp8": flashinfer_mxfp8,
    "flashinfer_nvfp4": flashinfer_nvfp4,
    "mori_fp8_blockwise_fnuz": _mori_blockwise(240.0, e4m3fnuz),
    "mori_fp8_blockwise_ocp": _mori_blockwise(448.0, e4m3),
    "mori_fp8_direct_cast_fnuz": _mori_direct_cast(e4m3fnuz),
    "mori_fp8_direct_cast_ocp": _mori_direct_cast(e4m3),
    "flydsl_fp8_blockwise_1x32": flydsl_fp8_blockwise_1x32,
}


def expected(name: str, x: torch.Tensor, amax=None) -> torch.Tensor:
    """The oracle's result for ``x`` as a tensor of ``x.dtype`` (built from NumPy bits).

    FP16 output saturates (every format's rule, ``WireFormat.qdq``): a finite FP16 input
    never comes back as ±inf, its result is clipped to ±65504 (a ceiling scale can round a
    value near 65504 up past it)."""
    xs = x.detach().cpu().to(torch.float32).numpy()
    with np.errstate(all="ignore"):
        out32 = ORACLES[name](xs, amax)
        if x.dtype == torch.float16:
            out32 = np.where(np.isfinite(xs), np.clip(out32, -65504.0, 65504.0), out32)
    out = np.ascontiguousarray(out32.astype(F32).astype(_NP_OF[x.dtype]))
    bits = out.view(np.int16 if x.dtype != torch.float32 else np.int32)
    return torch.from_numpy(bits.copy()).view(x.dtype)


def assert_bits_equal(
    actual: torch.Tensor, want: torch.Tensor, what: str = "", *, seed: int | None = None
) -> None:
    """Bit-for-bit equality; any NaN matches any NaN (payloads are not specified)."""
    assert_same_bits(actual, want, seed=seed, what=what)
