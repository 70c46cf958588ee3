"""Properties of every format: idempotence, shape/dtype preservation, hypothesis checks
against the oracle, kernel dispatch and its fallback."""

from __future__ import annotations

import sys
import types

import fmt_data
import fmt_oracle
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import moewire
from moewire import formats
from moewire.formats import base

NAMES = formats.names()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16in", "fp16in", "fp32in"]


def _amax(fmt, x):
    """The finite max (FP16 "heavy" data overflows to inf in places)."""
    finite = x.float()[torch.isfinite(x.float())]
    return finite.abs().amax() if fmt.needs_amax else None


# FP32 scales recomputed from the quantized block (row) by the reciprocal form
# ``amax * fl(1/c)``: on FP32 output the block max comes back as ``fl(448 * sf)`` (``fl(6 *
# bs)``), not as the original amax, and the new scale can be one ulp off. Every element keeps
# its code and moves by that ulp at most (DeepGEMM's and TensorRT-LLM's casts on CUDA do the
# same). BF16/FP16 output rounds the block max back to the amax exactly: no drift there.
_SCALE_ULP_DRIFT = ("fp8_b128", "nvfp4_token")


def _assert_same_up_to_scale_ulp(twice, once, keep, what):
    assert torch.equal(twice[keep] == 0, once[keep] == 0), what
    nonzero = keep & (once != 0)
    rel = ((twice - once).abs() / once.abs())[nonzero]
    worst = float(rel.max()) if rel.numel() else 0.0  # "tiny" FP32 data flushes to zero
    assert worst <= 2.0**-22, f"{what}: moved by {worst:.3g} (> 2 ulps)"


# bf16 on BF16 input is the identity, whose idempotence proves nothing (left out).
IDEM_CASES = [
    pytest.param(name, dtype, id=f"{name}-{dtype_id}")
    for name in NAMES
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS, strict=True)
    if not (name == "bf16" and dtype == torch.bfloat16)
]


@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "tiny"])
@pytest.mark.parametrize("name,dtype", IDEM_CASES)
def test_idempotent_with_a_fixed_scale(name, kind, dtype):
    x = fmt_data.make(kind, (4, 1024), dtype, fmt_data.seed_of("idem", name, kind, dtype))
    fmt = formats.get(name)
    amax = _amax(fmt, x)
    once = fmt.qdq(x, amax)
    twice = fmt.qdq(once, amax)
    drift = name in _SCALE_ULP_DRIFT and dtype == torch.float32
    what = f"{name}: q(q(x)) != q(x)"
    if name.startswith("nvfp4"):
        # Two documented exceptions of ModelOpt's math: torch's sign turns a -0.0 output
        # into +0.0, and a block whose E4M3 block scale is subnormal can re-round to a
        # different scale. Compare values, on the blocks with a normal E4M3 scale.
        xb = x.float().reshape(4, -1, 16)
        gs = amax / 2688 if name == "nvfp4" else xb.abs().amax(dim=(1, 2), keepdim=True) / 2688
        normal = (xb.abs().amax(-1, keepdim=True) / (6 * gs) >= 2.0**-6).expand_as(xb)
        assert normal.float().mean() > 0.1, "test data has too few normal-scale blocks"
        keep = normal.reshape(x.shape)
        if drift:
            _assert_same_up_to_scale_ulp(twice, once, keep, what)
        else:
            assert torch.equal(twice[keep], once[keep]), what
    elif name == "te_mxfp8":
        # TE quantizes a block whose scale byte is 0 (amax <= 448 * 2^-127) with a
        # reciprocal of 1 (exp2f_rcp), which flushes it: a block that the first pass brings
        # below that amax is zero the second time. Compare the other blocks bit for bit.
        ob = once.float().reshape(4, -1, 32)
        keep = (ob.abs().amax(-1, keepdim=True) > 448 * 2.0**-127).expand_as(ob)
        keep = keep.reshape(x.shape)
        fmt_oracle.assert_bits_equal(twice[keep], once[keep], what)
    elif drift:
        _assert_same_up_to_scale_ulp(twice, once, torch.isfinite(once), what)
    else:
        fmt_oracle.assert_bits_equal(twice, once, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1024,), (3, 1024), (2, 2, 1024), (0, 1024)], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_shape_and_dtype_preserved(name, shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.1
    fmt = formats.get(name)
    out = fmt.qdq(x, 1.0 if fmt.needs_amax else None)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    want = fmt_oracle.expected(name, x, 1.0 if fmt.needs_amax else None)
    fmt_oracle.assert_bits_equal(out, want, f"{name} {shape} {dtype}", seed=1)
    if x.numel():
        assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_input_equals_its_contiguous_copy(name):
    base_x = torch.randn(1024, 6, generator=torch.Generator().manual_seed(2)) * 0.1
    x = base_x.t()  # [6, 1024], last dim strided
    assert not x.is_contiguous()
    fmt = formats.get(name)
    amax = 1.0 if fmt.needs_amax else None
    assert torch.equal(fmt.qdq(x, amax), fmt.qdq(x.contiguous(), amax))


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_independent_for_row_local_formats(name):
    """A row-local format gives a row the same result whatever the other rows hold."""
    fmt = formats.get(name)
    assert fmt.row_local
    x = fmt_data.make("heavy", (4, 1024), torch.bfloat16, fmt_data.seed_of("rows", name))
    amax = 3.0 if fmt.needs_amax else None
    alone = fmt.qdq(x[1:2], amax)
    other = x.clone()
    other[0] *= 1000
    other[2:] = 0
    assert torch.equal(fmt.qdq(other, amax)[1:2], alone)


def test_attributes_match_the_issue():
    want = {
        # name: (element_bits, block_size, scale_bits, row_scale_bits, needs_amax)
        "bf16": (16, None, 0, 0, False),
        "fp8": (8, None, 0, 0, True),
        "fp8_b128": (8, 128, 32, 0, False),
        "fp8_b128_ue8m0": (8, 128, 8, 0, False),
        "fp8_b32_ue8m0": (8, 32, 8, 0, False),
        "mxfp8": (8, 32, 8, 0, False),
        "mxfp4": (4, 32, 8, 0, False),
        "nvfp4": (4, 16, 8, 0, True),
        "nvfp4_token": (4, 16, 8, 32, False),
        "logfmt10": (10, 128, 32, 0, False),
        "deepgemm_fp8_combine": (8, 128, 8, 0, False),
        "trtllm_32e4m3xe8m0": (8, 32, 8, 0, False),
        "te_mxfp8": (8, 32, 8, 0, False),
        "trtllm_16e2m1xbf16": (4, 16, 16, 0, False),
        "fp8_e4m3fnuz": (8, None, 0, 0, True),
        "flashinfer_mxfp8": (8, 32, 8, 0, False),
        "flashinfer_nvfp4": (4, 16, 16, 0, False),
        "mori_fp8_blockwise_fnuz": (8, 128, 32, 0, False),
        "mori_fp8_blockwise_ocp": (8, 128, 32, 0, False),
        "mori_fp8_direct_cast_fnuz": (8, None, 0, 0, False),
        "mori_fp8_direct_cast_ocp": (8, None, 0, 0, False),
        "flydsl_fp8_blockwise_1x32": (8, 32, 8, 0, False),
    }
    got = {
        n: (f.element_bits, f.block_size, f.scale_bits, f.row_scale_bits, f.needs_amax)
        for n in NAMES
        for f in [formats.get(n)]
    }
    assert got == want
    assert formats.get("nvfp4").wire_bits(7168) == 7168 * 4 + 448 * 8
    assert formats.get("nvfp4_token").wire_bits(7168) == 7168 * 4 + 448 * 8 + 32
    # The real combines' scales: one UE8M0 byte per 128 (DeepGEMM: hidden / 128 bytes a row
    # in combine_sf_buffer), one E8M0 byte per 32, one BF16 per 16.
    assert formats.get("deepgemm_fp8_combine").wire_bits(7168) == 7168 * 8 + 56 * 8
    assert formats.get("trtllm_32e4m3xe8m0").wire_bits(7168) == 7168 * 8 + 224 * 8
    assert formats.get("trtllm_16e2m1xbf16").wire_bits(7168) == 7168 * 4 + 448 * 16
    # FlashInfer's: the same planes as TensorRT-LLM's CombineFormats. MoRI's blockwise: one
    # FP32 scale per block (MoRI's scale_dim floats a row, 56 at H = 7168); its direct cast
    # and FNUZ per tensor: the FP8 bytes alone.
    assert formats.get("flashinfer_mxfp8").wire_bits(7168) == 7168 * 8 + 224 * 8
    assert formats.get("flashinfer_nvfp4").wire_bits(7168) == 7168 * 4 + 448 * 16
    assert formats.get("mori_fp8_blockwise_fnuz").wire_bits(7168) == 7168 * 8 + 56 * 32
    assert formats.get("mori_fp8_direct_cast_fnuz").wire_bits(7168) == 7168 * 8


def test_fake_quant_entry_point():
    x = torch.randn(2, 256)
    assert torch.equal(moewire.fake_quant(x, "mxfp4"), formats.get("mxfp4").qdq(x))
    assert torch.equal(moewire.fake_quant(x, "fp8", 2.0), formats.get("fp8").qdq(x, 2.0))
    assert formats.get(formats.get("fp8")) is formats.get("fp8")


# -- hypothesis: arbitrary FP32 values, NaN/inf included, against the oracle -------------

_finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True)
_moderate = st.floats(min_value=-1e4, max_value=1e4, width=32)


@st.composite
def _rows(draw):
    blocks = draw(st.integers(1, 2))
    rows = draw(st.integers(1, 3))
    elements = draw(st.sampled_from([_moderate, _finite_or_not]))
    return draw(hnp.arrays(np.float32, (rows, 128 * blocks), elements=elements))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=50, deadline=None)
@given(v=_rows(), amax=st.floats(min_value=0.0, max_value=1e6, width=32))
def test_hypothesis_matches_oracle(name, v, amax):
    x = torch.from_numpy(v)
    fmt = formats.get(name)
    a = amax if fmt.needs_amax else None
    fmt_oracle.assert_bits_equal(fmt.qdq(x, a), fmt_oracle.expected(name, x, a), name)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=50, deadline=None)
@given(v=hnp.arrays(np.float32, (2, 256), elements=_moderate))
def test_hypothesis_sign_symmetric_and_bounded(name, v):
    """q(-x) = -q(x) by value (nvfp4 uses torch's sign, whose zero has no sign), and no
    finite input gives NaN."""
    x = torch.from_numpy(v)
    fmt = formats.get(name)
    amax = float(np.abs(v).max()) if fmt.needs_amax else None
    out = fmt.qdq(x, amax)
    assert torch.isfinite(out).all()
    assert torch.equal(fmt.qdq(-x, amax), -out)


# -- kernel dispatch ------------------------------------------------------------------


def _fake_kernels(monkeypatch, **attrs):
    mod = types.ModuleType("moewire.kernels")
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, "moewire.kernels", mod)
    monkeypatch.setattr(moewire, "kernels", mod, raising=False)


def test_kernel_used_when_available_and_supported(monkeypatch):
    calls = []

    def qdq(x, name, amax):
        calls.append((name, amax))
        return x * 0

    _fake_kernels(monkeypatch, available=lambda: True, supports=lambda n: n == "mxfp4", qdq=qdq)
    x = torch.randn(2, 64)
    assert torch.equal(base._kernel_qdq("mxfp4", x, None), x * 0)
    assert base._kernel_qdq("nvfp4", x, torch.tensor(1.0)) is None
    assert calls == [("mxfp4", None)]


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"available": lambda: True},
        {"available": lambda: False, "supports": lambda n: True, "qdq": None},
    ],
    ids=["empty-module", "partial-module", "unavailable"],
)
def test_kernel_missing_or_partial_falls_back(monkeypatch, attrs):
    _fake_kernels(monkeypatch, **attrs)
    assert base._kernel_qdq("mxfp4", torch.randn(2, 64), None) is None


def test_kernel_import_error_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "moewire.kernels", None)  # import raises ImportError
    if "kernels" in vars(moewire):
        monkeypatch.delattr(moewire, "kernels")
    assert base._kernel_qdq("mxfp4", torch.randn(2, 64), None) is None


def test_cpu_never_calls_the_kernel(monkeypatch):
    def boom(*a):
        raise AssertionError("kernel called for a CPU tensor")

    _fake_kernels(monkeypatch, available=lambda: True, supports=lambda n: True, qdq=boom)
    x = torch.randn(2, 64)
    assert torch.equal(formats.get("mxfp4").qdq(x), formats.get("mxfp4").reference(x, None))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16in", "fp32in"])
@pytest.mark.parametrize("name", NAMES)
def test_cuda_reference_and_kernel_equal_cpu(name, dtype):
    """on an H200: the CUDA reference and the dispatched kernel equal the CPU reference.

    The references divide by constants as ``t * fl(1/c)`` on both devices (torch's own CUDA
    division by a Python scalar; its CPU one is a true division), so this holds bit for bit.
    FP32 output shows a one-ulp change of an FP32 scale that a BF16 output may round away.
    """
    x = fmt_data.make("heavy", (64, 2048), dtype, fmt_data.seed_of("gpu", name, dtype))
    fmt = formats.get(name)
    amax = 20.0 if fmt.needs_amax else None
    cpu = fmt.qdq(x, amax)
    ref = fmt.qdq(x.cuda(), amax, use_kernel=False)
    fmt_oracle.assert_bits_equal(ref.cpu(), cpu, f"{name} CUDA reference vs CPU")
    fast = fmt.qdq(x.cuda(), None if amax is None else torch.tensor(amax, device="cuda"))
    fmt_oracle.assert_bits_equal(fast.cpu(), cpu, f"{name} CUDA qdq vs CPU")


def test_trtllm_fp4_block_with_a_subnormal_decode_scale_encodes_to_zeros():
    """A block whose decode scale ``bf16(amax) / 6`` is subnormal (the encoder's
    ``rcp.approx.ftz`` flushes it) encodes to zeros, never ``0 * inf = NaN`` for its zero
    element; the independent oracle agrees bit for bit."""
    tiny = float(np.finfo(np.float32).tiny)
    x = torch.full((1, 16), tiny)
    x[0, 0] = 0.0
    x[0, 1] = -tiny
    fmt = formats.get("trtllm_16e2m1xbf16")
    out = fmt.qdq(x)
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.zeros_like(out))
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("trtllm_16e2m1xbf16", x, None),
                                 "trtllm_16e2m1xbf16")
    # A block just above the flush keeps its values.
    y = torch.full((1, 16), 8 * tiny)
    assert torch.equal(fmt.qdq(y), y)
