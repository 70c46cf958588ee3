"""The layout check of a buffer that holds DeepGEMM's FP8 combine rows (``DG_USE_FP8_COMBINE=1``).

The rows are read as the kernel reads them (E4M3 bytes, one UE8M0 byte per (slot, token,
128 columns) right after them), dequantized by the exact power of two, summed in the
kernel's order in FP32 from +0.0 and rounded to BF16 once; that must equal ``y`` bit for
bit. The oracle here decodes the bytes with ml_dtypes and float64 powers of two and sums
in NumPy float32 (``mm_oracles.resum``), from the stand-in's own region bookkeeping.
"""

from __future__ import annotations

import ml_dtypes
import mm_oracles as oracles
import numpy as np
import pytest
import torch
from mm_helpers import SHAPES, Model, batch

import moewire
from moewire.megamoe import flavours, layout, layout_check, quant_experts
from moewire.megamoe.convert import convert, unconvert
from moewire.megamoe.layout_check import layout_checked
from moewire.quantizer import WireQuantizer

T = 20
MMA = "fp8xfp4"  # the sgl-deep-gemm kernel with the FP8 combine; H = 512: four scale tiles
H = SHAPES[MMA][0]
KERNEL = "fp8_fp4_mega_moe"


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


@pytest.fixture(scope="module")
def fp8_combine_model():
    """One fp8xfp4 layer whose buffer holds FP8 combine rows (weights take seconds to build:
    one model for the module; each test converts it and unconverts it after)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DG_USE_FP8_COMBINE", "1")
        model = Model(n=1, mma=MMA)
    assert model.layers[0].experts.get_symm_buffer().use_fp8_combine
    return model


@pytest.fixture
def experts(fp8_combine_model):
    """The layer converted, its combine quantizer disabled; unconverted after the test."""
    experts = convert(fp8_combine_model.layers[0].experts, "layers.0.experts")
    yield experts
    unconvert(experts)


def _oracle_y(buf, t: int) -> np.ndarray:
    """BF16 bits ``[t, H]`` of the FP8 combine, from the buffer's bytes: E4M3 by ml_dtypes,
    scales ``2.0 ** (byte - 127)`` in float64, valid slots summed in float32 from +0."""
    start_q, n_q = buf._moewire_regions["combine"]
    start_sf, n_sf = buf._moewire_regions["combine_sf"]
    raw = buf.buffer.view(torch.uint8).numpy()
    q = raw[start_q : start_q + n_q].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sf = raw[start_sf : start_sf + n_sf].astype(np.float64)
    slots, tmax = buf.num_slots, buf.num_max_tokens_per_rank
    values = q.reshape(slots, tmax, H // 128, 128) * np.exp2(sf - 127).reshape(
        slots, tmax, H // 128, 1
    )
    rows = values.reshape(slots, tmax, H).astype(np.float32)
    return oracles.resum(rows, buf.topk_idx[:t].numpy(), t)


def test_dispatch_only_recipe_runs_and_proves_the_fp8_combine(fp8_combine_model, experts):
    x, w, ids = batch(T, H, seed=11, scale=2.0)
    moewire.quantize(fp8_combine_model, "moe_dispatch_fp8",
                     forward_loop=lambda m: m(x, w, ids))
    buf = experts.get_symm_buffer()
    assert layout_checked(buf)  # the calibration batch was the first routed one
    layout_check.reset_layout_checks()
    y = experts(x, w, ids)  # now with the dispatch quantized
    assert layout_checked(buf)
    np.testing.assert_array_equal(oracles.torch_bits(y), _oracle_y(buf, T))


def test_once_proven_the_rows_are_not_read_again(experts, monkeypatch):
    x, w, ids = batch(T, H, seed=12)
    experts(x, w, ids)
    assert layout_checked(experts.get_symm_buffer())

    def never(*args, **kwargs):
        raise AssertionError("the FP8 rows were read after the check had passed")

    monkeypatch.setattr(quant_experts, "combine_fp8_rows", never)
    experts(x, w, ids)


def test_an_all_padding_batch_defers_the_check(experts):
    x, w, ids = batch(T, H, seed=13)
    experts(x, w, torch.full_like(ids, -1))
    assert not layout_checked(experts.get_symm_buffer())
    experts(x, w, ids)
    assert layout_checked(experts.get_symm_buffer())


def _corrupt(what: str):
    """A kernel whose buffer, after the call, differs from what produced ``y``."""

    def after(buf, t):
        s, tok = torch.nonzero(buf.topk_idx[:t].T >= 0)[0].tolist()
        q, sf = buf.combine_fp8()
        if what == "fp8_byte":
            q.view(torch.uint8)[s, tok, 5] ^= 0x01
        else:
            sf[s, tok, 1] += 1

    return after


@pytest.mark.parametrize("what", ["fp8_byte", "scale_byte"])
def test_a_changed_row_fails_the_check(experts, monkeypatch, what):
    """Break: skip the check (or read the rows from a copy taken before the kernel)."""
    from moewire.reference import deep_gemm

    kernel = deep_gemm.fp8_fp4_mega_moe
    corrupt = _corrupt(what)

    def corrupting(y, l1, l2, buf, **kwargs):
        kernel(y, l1, l2, buf, **kwargs)
        corrupt(buf, y.shape[0])

    monkeypatch.setattr(deep_gemm, "fp8_fp4_mega_moe", corrupting)
    x, w, ids = batch(T, H, seed=14)
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(x, w, ids)


# -- readings the check must reject ----------------------------------------------------------


def _reading(buf, variant: str, t: int) -> torch.Tensor:
    """FP32 rows ``[k, t, H]`` of the buffer read as ``variant``."""
    q, sf = layout.combine_fp8_rows(buf, flavours.get("vllm-0.33"), KERNEL)
    if variant == "scales_shifted_by_one_byte":
        flat = sf.flatten()
        sf = torch.cat([flat[1:], flat[:1]]).view_as(sf)
    elif variant == "scales_before_rows":
        # Scale bytes first, then the rows: the same bytes, split the other way.
        start, _ = buf._moewire_regions["combine"]
        nq, nsf = q.numel(), sf.numel()
        raw = buf.buffer.view(torch.uint8)[start : start + nq + nsf]
        sf = raw[:nsf].view_as(sf)
        q = raw[nsf:].view(torch.float8_e4m3fn).view_as(q)
    elif variant == "scales_token_major":
        sf = sf.transpose(0, 1).reshape(sf.shape)
    return layout.dequantize_fp8_rows(q, sf, t)


VARIANTS = [
    "as_the_kernel", "descending_slots", "scales_shifted_by_one_byte", "scales_before_rows",
    "scales_token_major",
]
# Not a variant: rounding each dequantized row to BF16 before the FP32 sum. An E4M3 value
# times a power of two has 4 significant bits, so that rounding changes nothing.


def _order_sensitive_token(buf, t: int) -> None:
    """Give the first token with every slot valid the rows 2^24, 2^16, 1, 1 (E4M3 1.0 times
    UE8M0 bytes 151, 143, 127, 127): added in ascending slot order the FP32 sum stays on the
    BF16 midpoint 2^24 + 2^16 (each +1 is a tie, to even) and rounds down to 2^24; added
    descending it is 2^24 + 65538 and rounds up to 2^24 + 2^17."""
    topk = buf.topk_idx[:t]
    tok = int(torch.nonzero((topk >= 0).all(dim=1))[0])
    q, sf = buf.combine_fp8()
    for s, byte in enumerate([151, 143, 127, 127]):
        q[s, tok] = torch.ones(H).to(torch.float8_e4m3fn)
        sf[s, tok] = byte


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_kernels_reading_passes(experts, variant):
    """``y`` is the NumPy oracle's sum of the buffer's bytes, with one token whose sum
    depends on the order of the slots."""
    x, w, ids = batch(T, H, seed=15, scale=3.0, masked=0.3)
    experts(x, w, ids)
    buf = experts.get_symm_buffer()
    _order_sensitive_token(buf, T)
    y = torch.from_numpy(_oracle_y(buf, T).view(np.int16)).view(torch.bfloat16)
    topk = buf.topk_idx[:T].clone()
    rows = _reading(buf, variant, T)
    if variant == "descending_slots":
        rows, topk = rows.flip(0), topk.flip(1)
    call = layout_check.Combine(rows, topk, T, None, None, y, flavours.get("vllm-0.33"), KERNEL)
    state = layout_check._BufferCheck(generation=-1)
    if variant == "as_the_kernel":
        layout_check.check("layers.0.experts", state, call)
        assert state.checked
    else:
        with pytest.raises(RuntimeError, match="layout check failed"):
            layout_check.check("layers.0.experts", state, call)


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["calibrate", "quantize"])
def test_a_combine_quantizer_on_the_fp8_combine_is_refused(experts, mode):
    quantizer = WireQuantizer("deepgemm_fp8_combine")
    quantizer.mode = mode
    experts.combine_quantizer = quantizer
    x, w, ids = batch(T, H, seed=16)
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"layers\.0\.experts: the combine quantizer .* "
                                           r"would quantize it twice"):
        experts(x, w, ids)
    assert torch.equal(x, before)
    assert not layout_checked(experts.get_symm_buffer())


def test_a_bf16_reading_of_the_fp8_bytes_is_caught(experts, monkeypatch):
    """Force the BF16 reader onto the FP8 buffer (both guards say BF16): the check fails."""
    monkeypatch.setattr(layout, "holds_fp8_combine", lambda buf: False)
    monkeypatch.setattr(quant_experts, "holds_fp8_combine", lambda buf: False)
    quantizer = WireQuantizer("mxfp8")
    quantizer.mode = "calibrate"
    experts.combine_quantizer = quantizer
    x, w, ids = batch(T, H, seed=17)
    with pytest.raises((RuntimeError, ValueError), match="layout check failed|does not fit"):
        experts(x, w, ids)
    assert not layout_checked(experts.get_symm_buffer())


def test_the_bf16_reader_refuses_an_fp8_buffer(experts):
    with pytest.raises(ValueError, match="read them with combine_fp8_rows"):
        layout.combine_rows(experts.get_symm_buffer(), "vllm-0.33", KERNEL)


def test_the_fp8_reader_refuses_a_bf16_buffer():
    model = Model(n=1)
    with pytest.raises(ValueError, match="holds BF16 combine rows"):
        layout.combine_fp8_rows(model.layers[0].experts.get_symm_buffer(), "vllm-0.33",
                                "bf16_mega_moe")


def test_the_fp8_reader_refuses_a_hidden_size_off_the_scale_tile(experts):
    from types import SimpleNamespace

    real = experts.get_symm_buffer()
    odd = SimpleNamespace(use_fp8_combine=True, buffer=real.buffer, hidden=200,
                          num_topk=real.num_topk, num_max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="hidden=200 is not a multiple of 128"):
        layout.combine_fp8_rows(odd, "vllm-0.33", KERNEL)


def test_dequantize_is_exact_at_the_scale_extremes():
    """Byte 1 times the smallest E4M3 subnormal (an FP32 subnormal), byte 247 (the largest
    a BF16 tile gives: ``ceil(log2(bf16_max / 448)) = 120``) times 240, byte 0 (a zero tile)."""
    q = torch.tensor([2.0**-9, 240.0, 0.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    q = q.repeat_interleave(128).view(3, 1, 128)
    sf = torch.tensor([[[1]], [[247]], [[0]]], dtype=torch.uint8)
    got = layout.dequantize_fp8_rows(q, sf, 1)[:, 0, 0].tolist()
    assert got == [2.0**-135, 240.0 * 2.0**120, 0.0]


# -- under CUDA-graph capture ----------------------------------------------------------------


@pytest.mark.parametrize("corrupted", [False, True], ids=["intact", "corrupted"])
def test_under_capture_the_check_is_a_device_assert(experts, monkeypatch, corrupted):
    """Inside a capture (simulated: ``_capturing`` says so; on CPU ``torch._assert_async``
    evaluates at once) the FP8 check is the torch comparison recorded as a device-side
    assert: no host read, no fused kernel, the buffer not marked checked. Break: skip the
    comparison under capture, and the corrupted case passes."""
    from moewire.reference import deep_gemm

    monkeypatch.setattr(layout_check, "_capturing", lambda t: True)
    monkeypatch.setattr(layout_check.kernels, "fused_combine", None)  # never called
    if corrupted:
        kernel = deep_gemm.fp8_fp4_mega_moe

        def corrupting(y, l1, l2, buf, **kwargs):
            kernel(y, l1, l2, buf, **kwargs)
            _corrupt("fp8_byte")(buf, y.shape[0])

        monkeypatch.setattr(deep_gemm, "fp8_fp4_mega_moe", corrupting)
    x, w, ids = batch(T, H, seed=18)
    with pytest.warns(UserWarning, match="runs inside the CUDA graph being captured"):
        if corrupted:
            with pytest.raises(RuntimeError, match="layout check failed"):
                experts(x, w, ids)
        else:
            experts(x, w, ids)
    assert not layout_checked(experts.get_symm_buffer())
