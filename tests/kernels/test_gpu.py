"""The compiled Triton kernels on CUDA against the torch definitions on CUDA (the H200).

Run there with ``pytest -m gpu tests/kernels``; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.cases import (
    DISTRIBUTIONS,
    FORMATS,
    amax_for,
    combine_case,
    reference_combine,
    router_weights,
    sample,
    valid_routed_max,
)

from bitexact import assert_same_bits, seed_of
from moewire import formats, kernels

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(*key))


@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_bit_exact_cuda(fmt, dist, hidden):
    x = sample((96, hidden), dist, _gen(fmt, dist, hidden)).to(CUDA)
    amax = amax_for(fmt, x)
    got = kernels.qdq(x, fmt, amax)
    want = formats.get(fmt).reference(x, amax)
    assert_same_bits(got, want, seed=seed_of(fmt, dist, hidden), what=f"qdq {fmt}/{dist}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_special_values_cuda(fmt):
    x = sample((8, 512), "normal", _gen(fmt)).to(CUDA)
    x[0, 5], x[1, 17], x[2, 100], x[3, 0] = float("nan"), float("inf"), -float("inf"), -0.0
    amax = torch.tensor(6.0, device=CUDA)
    got = kernels.qdq(x, fmt, amax)
    assert_same_bits(got, formats.get(fmt).reference(x, amax), seed=seed_of(fmt), what=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_qdq_uses_the_kernel_and_agrees(fmt):
    x = sample((16, 1024), "heavy", _gen("fmt", fmt)).to(CUDA)
    amax = amax_for(fmt, x)
    fast = formats.get(fmt).qdq(x, amax)
    slow = formats.get(fmt).qdq(x, amax, use_kernel=False)
    assert_same_bits(fast, slow, seed=seed_of("fmt", fmt), what=f"{fmt} kernel vs reference")


@pytest.mark.parametrize("shared_slot", [None, "first", "last"], ids=["noshared", "first", "last"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_combine_bit_exact_cuda(fmt, shared_slot):
    t, hidden = 77, 7168
    rows, idx, amax = combine_case(
        fmt, k=6, tmax=96, num_tokens=t, hidden=hidden, shared_slot=shared_slot,
        gen=_gen(fmt, shared_slot), device=CUDA, dist="heavy",
    )
    want = reference_combine(rows, idx, t, fmt, amax, shared_slot)
    out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device=CUDA)
    kernels.fused_combine(rows, idx, t, out, fmt, amax, shared_slot)
    assert not torch.isnan(out).any(), "stale NaN leaked"
    assert_same_bits(out, want, seed=seed_of(fmt, shared_slot), what=f"combine {fmt}")


@pytest.mark.parametrize("shared_slot", [None, "last"], ids=["noshared", "last"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_combine_weighted_bit_exact_cuda(fmt, shared_slot):
    """The NVFP4 kernel's unweighted rows: ``acc = fma(q, w, acc)``, one rounding a slot."""
    t, hidden = 77, 7168
    gen = _gen("weighted", fmt, shared_slot)
    rows, idx, amax = combine_case(
        fmt, k=6, tmax=96, num_tokens=t, hidden=hidden, shared_slot=shared_slot,
        gen=gen, device=CUDA, dist="heavy",
    )
    weights = router_weights(96, 6, gen, device=CUDA)
    want = reference_combine(rows, idx, t, fmt, amax, shared_slot, weights)
    out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device=CUDA)
    kernels.fused_combine(rows, idx, t, out, fmt, amax, shared_slot, weights=weights)
    assert not torch.isnan(out).any(), "stale NaN leaked"
    assert_same_bits(out, want, seed=seed_of("weighted", fmt), what=f"weighted {fmt}")


@pytest.mark.parametrize("shared_slot", [None, "first", "last"], ids=["noshared", "first", "last"])
def test_check_flag_and_calibration_cuda(shared_slot):
    t, hidden = 50, 4096
    rows, idx, amax = combine_case(
        "nvfp4", k=6, tmax=64, num_tokens=t, hidden=hidden, shared_slot=shared_slot,
        gen=_gen("check", shared_slot), device=CUDA,
    )
    y = reference_combine(rows, idx, t, "bf16", None, shared_slot)
    flag = torch.zeros(1, dtype=torch.int32, device=CUDA)
    calib = torch.zeros(1, dtype=torch.float32, device=CUDA)
    out = torch.empty_like(y)
    kernels.fused_combine(rows, idx, t, out, "nvfp4", amax, shared_slot, y, flag, calib)
    assert int(flag) == 0
    assert float(calib) == float(valid_routed_max(rows, idx, t, shared_slot))
    want = reference_combine(rows, idx, t, "nvfp4", amax, shared_slot)
    assert_same_bits(out, want, seed=seed_of("check", shared_slot), what="nvfp4 with check")

    tok, slot = (int(v) for v in (idx[:t] >= 0).nonzero()[3])
    rows[slot, tok, 1000] += 1.0
    kernels.fused_combine(rows, idx, t, out, "nvfp4", amax, shared_slot, y, flag)
    assert int(flag) >= 1


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "nvfp4_token"])
def test_check_counts_every_mismatching_element_cuda(fmt):
    """Exactly one per mismatching (token, column), across threads, warps and programs
    (H 7168: 1024-column programs, several warps each; the masked per-thread atomics)."""
    t, hidden = 40, 7168
    rows, idx, amax = combine_case(
        fmt, k=6, tmax=64, num_tokens=t, hidden=hidden, shared_slot=None,
        gen=_gen("count", fmt), device=CUDA,
    )
    idx[:t, 0] = 0  # every token routes slot 0, with finite rows there
    finite = torch.randn(t, hidden, generator=torch.Generator().manual_seed(5))
    rows[0, :t] = finite.to(CUDA).to(rows.dtype)
    y = reference_combine(rows, idx, t, "bf16", None, None)
    corrupt = [(0, 0), (0, 7), (0, 8), (0, 1023), (0, 1024), (5, 300), (5, 7167), (39, 4096)]
    for tok, col in corrupt:
        rows[0, tok, col] += 64.0
    flag = torch.zeros(1, dtype=torch.int32, device=CUDA)
    out = torch.empty_like(y)
    kernels.fused_combine(rows, idx, t, out, fmt, amax, None, y, flag)
    assert int(flag) == len(corrupt)


def test_graph_replay_equals_eager():
    t, hidden = 64, 7168
    rows, idx, amax = combine_case(
        "nvfp4", k=6, tmax=64, num_tokens=t, hidden=hidden, shared_slot="last",
        gen=_gen("graph"), device=CUDA,
    )
    y = reference_combine(rows, idx, t, "bf16", None, "last")
    out = torch.empty_like(y)
    flag = torch.zeros(1, dtype=torch.int32, device=CUDA)
    calib = torch.zeros(1, dtype=torch.float32, device=CUDA)
    args = (rows, idx, t, out, "nvfp4", amax, "last", y, flag, calib)
    kernels.fused_combine(*args)  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.fused_combine(*args)
    # New data in the same places (stale NaN rows stay stale), as the next batch would be.
    fresh = torch.randn(rows.shape, generator=_gen("graph", 2)).to(torch.bfloat16).to(CUDA)
    rows.copy_(torch.where(torch.isnan(rows), rows, fresh))
    y.copy_(reference_combine(rows, idx, t, "bf16", None, "last"))
    flag.zero_()
    calib.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = reference_combine(rows, idx, t, "nvfp4", amax, "last")
    assert_same_bits(out, want, seed=seed_of("graph", 2), what="nvfp4 graph replay")
    assert int(flag) == 0
    assert float(calib) == float(valid_routed_max(rows, idx, t, "last"))
    tok, slot = (int(v) for v in (idx[:t] >= 0).nonzero()[0])
    rows[slot, tok, 9] += 2.0  # a valid routed row ("last": routed slot s is row s)
    graph.replay()
    assert int(flag) >= 1


def test_available_on_cuda(monkeypatch):
    assert kernels.available()
    monkeypatch.setenv("MOEWIRE_DISABLE_KERNELS", "1")
    assert not kernels.available()


def _rcp_approx(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of FP32 CUDA ``x``, elementwise (FlashInfer's encoders'
    ``cute.arch.rcp_approx``), through Triton's inline PTX."""
    import triton
    import triton.language as tl

    @triton.jit
    def rcp_approx(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [v],
                                      dtype=tl.float32, is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)

    x = x.contiguous()
    y = torch.empty_like(x)
    rcp_approx[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def test_rcp_approx_is_exact_on_powers_of_two():
    """``flashinfer_mxfp8`` takes ``rcp.approx.ftz.f32(2^e) = 2^-e`` for its E8M0 scales
    2^-126 .. 2^126 (2^-127 is flushed, which the format handles apart)."""
    from moewire.formats._numerics import pow2

    k = torch.arange(-126, 127, device=CUDA, dtype=torch.int32)
    assert torch.equal(_rcp_approx(pow2(k)), pow2(-k))


def test_rcp_approx_model_is_this_gpus_instruction_on_every_bf16_decode_scale():
    """FlashInfer's NVFP4 combine encodes with ``rcp.approx.ftz.f32`` of its decode scale
    ``ds = fl(a * fl(1/6))``; ``flashinfer_nvfp4`` models it as the correctly rounded
    reciprocal moved by the offset measured for ``a``'s significand. On this GPU's MUFU the
    model must be the instruction on every positive normal BF16 ``a`` (so every E2M1 code of
    ``fl(x * enc)`` is the device's). Prints how many reciprocals the model moves."""
    from moewire.formats._numerics import mul_recip, rcp_approx_bf16_decode_scale

    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32, device=CUDA)  # positive normals
    a = bits.to(torch.int16).view(torch.bfloat16).float()
    ds = mul_recip(a, 6.0)
    normal = ds >= torch.finfo(torch.float32).tiny
    device, model = _rcp_approx(ds), rcp_approx_bf16_decode_scale(ds, a)
    moved = int((model != torch.reciprocal(ds))[normal].sum())
    print(f"the model moves {moved} of {int(normal.sum())} reciprocals off 1/ds")
    assert moved > 0
    assert torch.equal(device[normal].view(torch.int32), model[normal].view(torch.int32))
