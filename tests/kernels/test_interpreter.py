"""The Triton kernels under Triton's interpreter (CPU), against the torch definitions.

These run where CI runs (no GPU) when Triton is installed; the same kernels are checked on
CUDA by ``test_gpu.py``. Shapes are small: the interpreter runs each program in NumPy.
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

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("CUDA present: test_gpu.py checks the compiled kernels", allow_module_level=True)

from moewire import formats, kernels  # noqa: E402

# NumPy warns about the inf/NaN the special-value tests feed the interpreter on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_bit_exact(fmt, dist):
    gen = torch.Generator().manual_seed(seed_of(fmt, dist))
    x = sample((3, 256), dist, gen)
    amax = amax_for(fmt, x)
    got = kernels.qdq(x, fmt, amax)
    want = formats.get(fmt).reference(x, amax)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_same_bits(got, want, seed=seed_of(fmt, dist), what=f"qdq {fmt}/{dist}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_b128", "mxfp4", "nvfp4", "nvfp4_token"])
def test_qdq_other_dtypes_and_shapes(fmt, dtype):
    gen = torch.Generator().manual_seed(7)
    x = sample((2, 2, 128), "normal", gen, dtype=dtype)
    amax = amax_for(fmt, x)
    got = kernels.qdq(x, fmt, amax)
    assert got.dtype == dtype and got.shape == x.shape
    assert_same_bits(got, formats.get(fmt).reference(x, amax), seed=7, what=f"{fmt} {dtype}")


@pytest.mark.parametrize("fmt", ["fp8_b128", "nvfp4", "nvfp4_token"])
def test_qdq_divides_by_constants_in_the_reciprocal_form(fmt):
    """FP32 amaxes where ``a / c`` != ``a * fl(1/c)`` (c = 448, 2688): the kernel follows
    the reference's reciprocal form, on FP32 output, where a one-ulp scale change shows."""
    c = 448.0 if fmt == "fp8_b128" else 2688.0
    gen = torch.Generator().manual_seed(5)
    cand = torch.rand(4000, generator=gen) * 3.5 + 0.5
    split = cand[cand / c != cand * torch.tensor(1.0 / c)][:4]
    x = (torch.rand(4, 128, generator=gen) * 2 - 1) * split[:, None]
    x[:, 9] = split
    for row, a in zip(x, split, strict=True):
        got = kernels.qdq(row[None], fmt, a.reshape(()))
        want = formats.get(fmt).reference(row[None], a.reshape(()))
        assert_same_bits(got, want, seed=5, what=f"{fmt} a={float(a)!r}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_special_values(fmt):
    gen = torch.Generator().manual_seed(3)
    x = sample((4, 128), "normal", gen)
    x[0, 5], x[1, 17], x[2, 100], x[3, 0] = float("nan"), float("inf"), -float("inf"), -0.0
    amax = torch.tensor(6.0)
    got = kernels.qdq(x, fmt, amax)
    assert_same_bits(got, formats.get(fmt).reference(x, amax), seed=3, what=f"{fmt} specials")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_qdq_zero_amax_takes_the_fallback(fmt):
    x = sample((2, 128), "tiny", torch.Generator().manual_seed(1))
    amax = torch.tensor(0.0)
    want = formats.get(fmt).reference(x, amax)
    assert_same_bits(kernels.qdq(x, fmt, amax), want, seed=1, what=f"{fmt} amax=0")


@pytest.mark.parametrize("shared_slot", [None, "first", "last"], ids=["noshared", "first", "last"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_combine_bit_exact(fmt, shared_slot):
    gen = torch.Generator().manual_seed(seed_of(fmt, shared_slot))
    rows, idx, amax = combine_case(
        fmt, k=3, tmax=6, num_tokens=4, hidden=256, shared_slot=shared_slot, gen=gen
    )
    want = reference_combine(rows, idx, 4, fmt, amax, shared_slot)
    out = torch.full((4, 256), float("nan"), dtype=torch.bfloat16)
    kernels.fused_combine(rows, idx, 4, out, fmt, amax, shared_slot, block_h=128)
    assert not torch.isnan(out).any(), "stale NaN leaked"
    assert_same_bits(out, want, seed=seed_of(fmt, shared_slot), what=f"combine {fmt}")


@pytest.mark.parametrize("shared_slot", [None, "last"], ids=["noshared", "last"])
def test_check_flag_and_calibration(shared_slot):
    gen = torch.Generator().manual_seed(11)
    t = 5
    rows, idx, _ = combine_case(
        "mxfp4", k=3, tmax=8, num_tokens=t, hidden=128, shared_slot=shared_slot, gen=gen
    )
    y = reference_combine(rows, idx, t, "bf16", None, shared_slot)
    flag = torch.zeros(1, dtype=torch.int32)
    calib = torch.zeros(1, dtype=torch.float32)
    out = torch.empty_like(y)
    kernels.fused_combine(rows, idx, t, out, "mxfp4", None, shared_slot, y, flag, calib)
    assert int(flag) == 0
    assert float(calib) == float(valid_routed_max(rows, idx, t, shared_slot))
    want = reference_combine(rows, idx, t, "mxfp4", None, shared_slot)
    assert_same_bits(out, want, seed=11, what="mxfp4 combine with check")

    valid = (idx[:t] >= 0).nonzero()
    tok, slot = (int(v) for v in valid[0])
    rows[slot, tok, 7] = rows[slot, tok, 7] * 2 + 1
    kernels.fused_combine(rows, idx, t, out, "mxfp4", None, shared_slot, y, flag, calib)
    assert int(flag) >= 1

    flag.zero_()
    y2 = reference_combine(rows, idx, t, "bf16", None, shared_slot)
    kernels.fused_combine(rows, idx, t, y2, "bf16", None, shared_slot, y2, flag)
    assert int(flag) == 0, "check_against aliasing out must read y before writing it"


# Corrupted (token, column) pairs: columns in one thread's 8, in both halves of one NVFP4
# block (100 and 108: the same place in each 8-half) and in other threads' and
# blocks', on two tokens, so a count per program, per thread or per block would differ.
_CORRUPT = ((0, 3), (0, 4), (0, 21), (0, 100), (0, 108), (1, 127), (3, 64))


@pytest.mark.parametrize("fmt,block_h", [("bf16", None), ("mxfp4", 32), ("nvfp4", None),
                                         ("nvfp4", 32), ("nvfp4_token", None)])
def test_check_counts_every_mismatching_element(fmt, block_h):
    """The flag gains exactly one per mismatching (token, column), however the program
    splits the columns between threads and however many programs a row takes."""
    gen = torch.Generator().manual_seed(12)
    t = 4
    hidden = 128
    rows, idx, amax = combine_case(fmt, k=3, tmax=8, num_tokens=t, hidden=hidden,
                                   shared_slot=None, gen=gen)
    idx[:t, 0] = 0  # every token routes slot 0, with finite rows there
    rows[0, :t] = torch.randn(t, hidden, generator=torch.Generator().manual_seed(5)).to(rows.dtype)
    y = reference_combine(rows, idx, t, "bf16", None, None)
    for tok, col in _CORRUPT:
        rows[0, tok, col] += 64.0
    flag = torch.zeros(1, dtype=torch.int32)
    out = torch.empty_like(y)
    kernels.fused_combine(rows, idx, t, out, fmt, amax, None, y, flag, block_h=block_h)
    assert int(flag) == len(_CORRUPT)


def _refusal_args(**change):
    rows = torch.randn(3, 4, 128).to(torch.bfloat16)
    args = dict(
        rows=rows,
        topk_idx=torch.zeros(4, 3, dtype=torch.int64),
        num_tokens=4,
        out=torch.empty(4, 128, dtype=torch.bfloat16),
        fmt="mxfp4",
        amax=None,
        shared_position=None,
    )
    args.update(change)
    return args


REFUSALS = {
    "unknown-format": (dict(fmt="logfmt10"), ValueError, "no kernel"),
    "rows-fp32": (dict(rows=torch.randn(3, 4, 128)), ValueError, "rows must be a BF16"),
    "slot-count": (dict(shared_position="last"), ValueError, "needs 4"),
    "too-many-tokens": (dict(num_tokens=5), ValueError, "num_tokens=5"),
    "out-shape": (dict(out=torch.empty(3, 128, dtype=torch.bfloat16)), ValueError, "out must"),
    "fp8-no-amax": (dict(fmt="fp8"), ValueError, "needs an amax"),
    "bad-shared": (dict(shared_position="middle"), ValueError, "shared_position"),
    "weights-fp16": (
        dict(weights=torch.rand(4, 3).half()), ValueError, "weights must be the staged"
    ),
    "weights-short": (dict(weights=torch.rand(3, 3)), ValueError, r"FP32 \[>= 4, 3\]"),
    "check-without-flag": (
        dict(check_against=torch.empty(4, 128, dtype=torch.bfloat16)),
        ValueError,
        "together",
    ),
    "float-num-tokens": (dict(num_tokens=4.0), TypeError, "num_tokens must be an int"),
}


@pytest.mark.parametrize("change,exc,match", REFUSALS.values(), ids=REFUSALS.keys())
def test_fused_combine_refusals(change, exc, match):
    with pytest.raises(exc, match=match):
        kernels.fused_combine(**_refusal_args(**change))


def test_qdq_refuses_unaligned_hidden():
    with pytest.raises(ValueError, match="not a multiple"):
        kernels.qdq(torch.randn(2, 48).to(torch.bfloat16), "mxfp4", None)


def test_supports_and_available():
    assert all(kernels.supports(f) for f in FORMATS)
    assert all(kernels.supports(formats.get(f).facts) for f in FORMATS)
    assert not kernels.supports("logfmt10")
    assert not kernels.supports(formats.get("logfmt10").facts)
    assert not kernels.supports("no_such_format")
    assert kernels.available() is False  # no CUDA here


def test_kernels_take_a_format_row_or_its_name():
    """``WireFormat.facts`` (the row) and the name launch the same kernel, bit for bit."""
    seed = seed_of("row-or-name")
    x = sample((2, 256), "normal", torch.Generator().manual_seed(seed))
    amax = amax_for("nvfp4", x)
    by_row = kernels.qdq(x, formats.get("nvfp4").facts, amax)
    assert_same_bits(by_row, kernels.qdq(x, "nvfp4", amax), seed=seed, what="row vs name")


# -- weighted (FMA) combine: the NVFP4 kernel's unweighted rows -------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["weighted_rows", "unweighted_rows"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_combine_fp32_accumulation_bit_exact(fmt, weighted):
    """``accumulate="fp32"``: the FP32 dequantized rows are added unrounded, as in
    ``resum(accumulate="fp32")``."""
    seed = seed_of("fp32acc", fmt, weighted)
    gen = torch.Generator().manual_seed(seed)
    rows, idx, amax = combine_case(
        fmt, k=3, tmax=6, num_tokens=4, hidden=256, shared_slot="last", gen=gen
    )
    weights = router_weights(6, 3, gen) if weighted else None
    want = reference_combine(rows, idx, 4, fmt, amax, "last", weights, accumulate="fp32")
    out = torch.full((4, 256), float("nan"), dtype=torch.bfloat16)
    kernels.fused_combine(rows, idx, 4, out, fmt, amax, "last", weights=weights,
                          accumulate="fp32", block_h=128)
    assert not torch.isnan(out).any(), "stale NaN leaked"
    assert_same_bits(out, want, seed=seed, what=f"fp32-accumulated combine {fmt}")


@pytest.mark.parametrize("accumulate", ["bf16", "fp32"])
def test_fused_combine_accumulation_modes_differ_on_fp4_with_bf16_scale(accumulate):
    """E2M1 times a BF16-derived FP32 scale needs ~10 significant bits: the two modes give
    different sums here, and each mode of the kernel equals that mode of the definition
    (a kernel with the modes swapped fails)."""
    fmt = "trtllm_16e2m1xbf16"
    gen = torch.Generator().manual_seed(21)
    rows, idx, amax = combine_case(
        fmt, k=4, tmax=6, num_tokens=4, hidden=256, shared_slot=None, gen=gen
    )
    other = "fp32" if accumulate == "bf16" else "bf16"
    want = reference_combine(rows, idx, 4, fmt, amax, None, accumulate=accumulate)
    not_want = reference_combine(rows, idx, 4, fmt, amax, None, accumulate=other)
    assert not torch.equal(want, not_want), "test data does not separate the modes"
    out = torch.empty((4, 256), dtype=torch.bfloat16)
    kernels.fused_combine(rows, idx, 4, out, fmt, amax, None, accumulate=accumulate)
    assert_same_bits(out, want, seed=21, what=f"{fmt} accumulate={accumulate}")


@pytest.mark.parametrize("shared_slot", [None, "first", "last"], ids=["noshared", "first", "last"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_combine_weighted_bit_exact(fmt, shared_slot):
    """``acc = fma(q(row), w, acc)`` with one rounding per slot, as ``resum(weights=)``."""
    seed = seed_of("weighted", fmt, shared_slot)
    gen = torch.Generator().manual_seed(seed)
    rows, idx, amax = combine_case(
        fmt, k=3, tmax=6, num_tokens=4, hidden=256, shared_slot=shared_slot, gen=gen
    )
    weights = router_weights(6, 3, gen)
    want = reference_combine(rows, idx, 4, fmt, amax, shared_slot, weights)
    out = torch.full((4, 256), float("nan"), dtype=torch.bfloat16)
    kernels.fused_combine(
        rows, idx, 4, out, fmt, amax, shared_slot, weights=weights, block_h=128
    )
    assert not torch.isnan(out).any(), "stale NaN leaked"
    assert_same_bits(out, want, seed=seed, what=f"weighted combine {fmt}")


# One crafted element where one FMA rounding and a multiply-then-add differ after the BF16
# rounding: acc = fma(2, 0.5, 0) = 1; then r * w = 2^-8 + 2^-24 + e (0 < e < 2^-32) rounds
# to the FP32 tie 1 + 2^-8 + 2^-24 when added after its own rounding (-> 1 + 2^-8, then
# BF16 1.0), but lands above the tie with one rounding (-> BF16 1.0078125).
CRAFTED_R, CRAFTED_W = 0.003936767578125, 0.9922632575035095


def test_weighted_kernel_rounds_once_where_multiply_then_add_differs():
    gen = torch.Generator().manual_seed(seed_of("weighted-crafted"))
    rows, idx, _ = combine_case(
        "bf16", k=3, tmax=6, num_tokens=4, hidden=128, shared_slot=None, gen=gen
    )
    weights = router_weights(6, 3, gen)
    idx[0] = torch.tensor([5, 9, -1])
    rows[0, 0, 0], rows[1, 0, 0] = 2.0, CRAFTED_R
    weights[0, 0], weights[0, 1] = 0.5, CRAFTED_W
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    kernels.fused_combine(rows, idx, 4, out, "bf16", None, None, weights=weights)
    assert float(out[0, 0]) == 1.0078125, "the kernel does not round the weighted add once"
    want = reference_combine(rows, idx, 4, "bf16", None, None, weights)
    assert_same_bits(out, want, seed=None, what="weighted bf16 with the crafted element")
    acc = torch.tensor(2.0) * torch.tensor(0.5)
    acc = acc + torch.tensor(CRAFTED_R) * torch.tensor(CRAFTED_W)
    assert float(acc.to(torch.bfloat16)) == 1.0, "the crafted element does not separate"


@pytest.mark.parametrize("shared_slot", [None, "last"], ids=["noshared", "last"])
def test_weighted_check_flag_and_calibration(shared_slot):
    """The layout check compares the weighted unquantized sum; calibration sees the
    unweighted rows (what the NVFP4 kernel leaves in the region)."""
    gen = torch.Generator().manual_seed(13)
    t = 5
    rows, idx, amax = combine_case(
        "nvfp4", k=3, tmax=8, num_tokens=t, hidden=128, shared_slot=shared_slot, gen=gen
    )
    weights = router_weights(8, 3, gen)
    y = reference_combine(rows, idx, t, "bf16", None, shared_slot, weights)
    flag = torch.zeros(1, dtype=torch.int32)
    calib = torch.zeros(1, dtype=torch.float32)
    out = torch.empty_like(y)
    kernels.fused_combine(
        rows, idx, t, out, "nvfp4", amax, shared_slot, y, flag, calib, weights=weights
    )
    assert int(flag) == 0
    assert float(calib) == float(valid_routed_max(rows, idx, t, shared_slot))
    want = reference_combine(rows, idx, t, "nvfp4", amax, shared_slot, weights)
    assert_same_bits(out, want, seed=13, what="weighted nvfp4 combine with check")
    # The unweighted sum is not the kernel's y: the check must see the difference.
    kernels.fused_combine(rows, idx, t, out, "nvfp4", amax, shared_slot, y, flag)
    assert int(flag) >= 1


def test_the_split_formats_are_the_16_element_block_formats():
    """The launchers pass a row's ``split_tile`` to the kernels (the tile layout) and size its
    programs one 16-element block per thread: the split rows are the kernel formats with
    16-element blocks, or a program would hold half blocks (wrong warps) or replicate
    elements."""
    from moewire.format_table import FORMATS as ROWS

    split = {name for name in FORMATS if ROWS[name].split_tile}
    assert split == {name for name in FORMATS if ROWS[name].block_size == 16}
    assert split == {"nvfp4", "nvfp4_token", "trtllm_16e2m1xbf16", "flashinfer_nvfp4"}


def test_a_16_element_block_kernel_refuses_a_row_without_the_split_tile():
    """The kernel's 16-element block branches assert the split tile: a row that says
    otherwise does not compile rather than computing half blocks."""
    import dataclasses

    row = dataclasses.replace(formats.get("flashinfer_nvfp4").facts, split_tile=False)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(Exception, match="SPLIT"):
        kernels.qdq(x, row, None)


@pytest.mark.parametrize(
    ("hidden", "fmt", "want"),
    [(7168, "nvfp4", (1024, 2)), (4096, "fp8", (1024, 4)), (3584, "nvfp4", (512, 1)),
     (3584, "mxfp4", (512, 2)), (7184, "fp8", (256, 1)), (256, "fp8", (256, 1)),
     (7168, "nvfp4_token", (8192, 16))],
)
def test_default_program_size_pads_the_row_least(hidden, fmt, want):
    """Kimi-K3's H = 3584 is seven 512-column programs, not four 1024-column ones with the
    last half empty; 8 columns a thread (NVFP4: one 16-element block a thread)."""
    bh = kernels.tuning.block_h(fmt, hidden, None)
    assert (bh, kernels.tuning.num_warps(fmt, bh, None)) == want


@pytest.mark.parametrize(
    ("hidden", "fmt", "want"),
    [(3584, "fp8", (1024, 4)), (3584, "nvfp4", (1024, 2)), (7168, "mxfp4", (1024, 4)),
     (7184, "fp8", (1024, 4)), (256, "fp8", (256, 1)), (7168, "nvfp4_token", (8192, 16))],
)
def test_dispatch_program_size_is_1024_columns(hidden, fmt, want):
    """The dispatch QDQ keeps 1024-column programs where the combine pads least (512 at
    H = 3584 was 18% slower for the one-pass QDQ on an H200)."""
    bh = kernels.tuning.block_h(fmt, hidden, None, pad_least=False)
    assert (bh, kernels.tuning.num_warps(fmt, bh, None)) == want


def test_qdq_launches_its_own_program_size(monkeypatch):
    """``qdq`` launches with the dispatch rule (1024 columns at H = 3584), not the
    combine's; the result is unchanged either way."""
    from moewire.kernels import _triton

    seen = []
    real = _triton.qdq_kernel

    class _Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid, kw["BLOCK_H"], kw["num_warps"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(_triton, "qdq_kernel", _Spy())
    seed = seed_of("qdq-program-size")
    x = (torch.randn(2, 3584, generator=torch.Generator().manual_seed(seed)) * 3).to(
        torch.bfloat16)
    amax = x.float().abs().amax()
    got = kernels.qdq(x, "fp8", amax)
    assert seen == [((2, 4), 1024, 4)]
    assert_same_bits(got, formats.get("fp8").reference(x, amax), seed=seed,
                     what="qdq fp8 at H = 3584")
