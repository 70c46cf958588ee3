"""The fused Triton kernel's weighted sums round once per slot.

The kernel weights the NVFP4 kernel's unweighted rows with ``_triton._fma``: ``tl.fma`` on
the GPU, and under Triton's interpreter (whose ``fma`` rounds twice) an emulation from
float64 with round-to-odd. It does so twice per slot: for the quantized sum ``acc`` (the
output) and for the unquantized check sum ``raw`` (the layout check compares it with the
kernel's ``y``: a wrong rounding there reports mismatches that are not there and stops a
correct layer). The data (``tests/rounding_cases.py``) sits at FP32 and BF16 ties, so one
rounding more or less changes the bits.

Each test runs under the interpreter on CPU, and compiled on CUDA (marked ``gpu``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import rounding_cases as rc
from bitexact import assert_same_bits, seed_of

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from cases import DEVICES  # noqa: E402

from moewire import kernels  # noqa: E402
from moewire.kernels import _triton  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@triton.jit
def _fma_probe(a_ptr, b_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr, HW_CAST: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _triton._fma(a, b, c, HW_CAST), mask=mask)


def _kernel_fma(cases, device):
    a, b, c = (torch.tensor([case[i] for case in cases], dtype=torch.float32, device=device)
               for i in range(3))
    out = torch.empty_like(a)
    block = 1024
    _fma_probe[(triton.cdiv(len(cases), block),)](
        a, b, c, out, len(cases), BLOCK=block, HW_CAST=device == "cuda",
        enable_fp_fusion=False,
    )
    return out.cpu()


def _assert_cases(got, cases, what):
    want = torch.tensor([rc.fma_oracle(*case[:3]) for case in cases], dtype=torch.float32)
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten().tolist()
    lines = [f"  {cases[i][3] if len(cases[i]) > 3 else cases[i][:3]}: got "
             f"{float(got[i])!r}, want {float(want[i])!r}" for i in bad[:8]]
    assert not bad, f"{what}: {len(bad)} of {len(cases)} cases differ:\n" + "\n".join(lines)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_fma_on_crafted_and_near_tie_cases(device):
    """``_triton._fma`` (the interpreter's float64 round-to-odd emulation; ``tl.fma`` on
    CUDA) on the crafted cases and 600 random near-tie cases, bit for bit against the
    exact-rational oracle.

    Catches (each verified by making the change in ``_triton._fma``): the float64 sum
    rounded to FP32 without the round-to-odd step (mutant
    ``kernel-fma-interpreter-round-to-nearest``), a step that ignores the sign of the sum
    (``tl.where(err > 0, 1, -1)``: wrong for negative sums, mutant
    ``kernel-fma-interpreter-step-ignores-sign``), moving odd sums too
    (``kernel-fma-interpreter-moves-odd-sums``), and a multiply then an add.
    """
    cases = rc.FMA_CASES + rc.near_tie_cases(seed_of("kernel-near-ties"))
    _assert_cases(_kernel_fma(cases, device), cases, f"_triton._fma on {device}")


def _rows(routed, shared, position):
    if position is None:
        return routed.clone()
    return torch.cat([routed, shared[None]]).contiguous()


@functools.cache
def _case(position):
    seed = seed_of("kernel-weighted-rounding", position)
    routed, shared, idx, weights, t = rc.make_tokens(seed)
    args = (routed.float().numpy(), shared.float().numpy(), idx.numpy(), weights.numpy(), t)
    return seed, _rows(routed, shared, position), idx, weights, t, args


@functools.cache
def _oracle(position, wrong=None):
    """The oracle's BF16 bits for :func:`_case` (``wrong``: one of :data:`rc.WRONG`)."""
    return rc.weighted_oracle(*_case(position)[5], position, wrong=wrong)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loop", ["unrolled", "rolled"])
@pytest.mark.parametrize("position", rc.POSITIONS, ids=rc.POSITION_IDS)
def test_fused_weighted_combine_rounds_once_per_slot(position, loop, device):
    """The fused combine's output (``bf16``: no quantization) with ``weights=``, on tokens
    where one FP32 rounding shows in BF16: the oracle's bits and the hand-derived table's.

    Catches (each verified by making the change in ``_combine_slot``'s ``_accumulate``): a
    multiply then an add (mutant ``kernel-weighted-multiply-then-add``), a BF16 rounding
    after each weighted add (``kernel-weighted-bf16-rounding-per-add``), and under the
    interpreter the FMA emulation's float64 sum rounded to nearest (no round-to-odd).
    """
    seed, rows, idx, weights, t, _ = _case(position)
    out = torch.full((t, rows.shape[2]), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.fused_combine(rows.to(device), idx.to(device), t, out, "bf16", None, position,
                          weights=weights.to(device), unroll=loop == "unrolled")
    want = _oracle(position)
    assert_same_bits(out, want, seed=seed, what=f"fused weighted bf16, shared {position}")
    n = len(rc.TOKENS)
    for col in rc.CRAFTED:
        assert_same_bits(out[:n, col], rc.expected_crafted(position), seed=seed,
                         what=f"fused weighted at crafted column {col}, shared {position}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("position", rc.POSITIONS, ids=rc.POSITION_IDS)
def test_weighted_check_passes_at_a_tie_and_counts_a_wrong_y(position, fmt, device):
    """The one-pass layout check's weighted unquantized sum (``raw``): the kernel's ``y``
    crafted at FP32/BF16 ties gives no mismatch, and a ``y`` from each wrong rounding of
    :data:`rc.WRONG` gives exactly as many mismatches as it has differing elements.

    Catches (each verified by making the change): the check sum as a multiply then an add
    (mutant ``kernel-weighted-check-multiply-then-add``: it reports mismatches on the
    correct ``y``), a BF16 rounding per add in the check sum
    (``kernel-weighted-check-bf16-rounding-per-add``), and under the interpreter the FMA
    emulation's float64 sum rounded to nearest.
    """
    seed, rows, idx, weights, t, _ = _case(position)
    rows_d, idx_d, w_d = rows.to(device), idx.to(device), weights.to(device)
    amax = torch.tensor(8.0, device=device) if fmt == "nvfp4" else None

    def mismatches(y_bits):
        y = torch.from_numpy(y_bits.view("int16")).view(torch.bfloat16).to(device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        out = torch.empty_like(y)
        kernels.fused_combine(rows_d, idx_d, t, out, fmt, amax, position, y, flag,
                              weights=w_d)
        return int(flag)

    want = _oracle(position)
    assert mismatches(want) == 0, (
        f"the weighted check reports mismatches on the right y ({fmt}, shared {position})")
    for wrong in rc.WRONG:
        y_wrong = _oracle(position, wrong)
        differing = int((y_wrong != want).sum())
        assert differing > 0, wrong
        assert mismatches(y_wrong) == differing, f"y from {wrong} ({fmt}, shared {position})"
