"""The fused Triton combine at its DEFAULT block size, on rows where order shows.

Under Triton's interpreter on CPU (CI), compiled on CUDA where there is a GPU, against the
independent NumPy oracle of ``tests/order_cases.py``: routed slots ascending, the shared row
first or last, one BF16 rounding. Formats with per-block scales keep the crafted values
exact, so the order still shows after quantization. Each format runs with the slot loop
unrolled and rolled (the default picks one by format, k and the check: ``kernels.tuning.unroll``),
so both loops are covered whatever the defaults.
"""

from __future__ import annotations

import pytest
import torch

from bitexact import assert_same_bits, seed_of
from order_cases import (
    CRAFTED,
    POSITION_IDS,
    POSITIONS,
    expected_crafted,
    make_case,
    oracle,
    stored_rows,
    wrong_variants,
)

pytest.importorskip("triton")

from moewire import formats, kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ORDER_FORMATS = ("bf16", "mxfp8", "mxfp4", "fp8_b32_ue8m0", "fp8_b128_ue8m0")


def _fused(rows, topk_idx, t, out, fmt, position, unroll=None):
    return kernels.fused_combine(
        rows.to(DEVICE), topk_idx.to(DEVICE), t, out, fmt, None, position, unroll=unroll
    )


@pytest.mark.parametrize("loop", ["unrolled", "rolled"])
@pytest.mark.parametrize("position", POSITIONS, ids=POSITION_IDS)
@pytest.mark.parametrize("fmt", ORDER_FORMATS)
def test_fused_combine_sums_in_the_kernel_order(fmt, position, loop):
    seed = seed_of("kernel-order", fmt, position)
    routed, shared, idx, t = make_case(seed)
    rows = stored_rows(routed, shared, position)
    out = torch.full((t, rows.shape[2]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    _fused(rows, idx, t, out, fmt, position, unroll=loop == "unrolled")
    q = formats.get(fmt).reference(routed, None).float().numpy()
    args = (q, shared.float().numpy(), idx.numpy(), t)
    want = oracle(*args, position)
    assert_same_bits(out, want, seed=seed, what=f"fused {fmt} vs oracle, shared {position}")
    for col in CRAFTED:
        assert_same_bits(out[:, col], expected_crafted(position), seed=seed, what=f"col {col}")
    for name, variant in wrong_variants(position).items():
        wrong = oracle(*args, **{"position": position, **variant})
        assert (wrong != want).any(), f"the data does not separate the kernel order from {name}"


def _check_count(rows, idx, t, y, fmt="bf16"):
    """The fused kernel's layout check against ``y``: mismatching elements counted."""
    rows, idx, y = rows.to(DEVICE), idx.to(DEVICE), y.to(DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(y)
    kernels.fused_combine(rows, idx, t, out, fmt, None, None, y, flag)
    return int(flag)


def test_fused_check_counts_a_one_ulp_difference():
    seed = seed_of("kernel-check-ulp")
    routed, shared, idx, t = make_case(seed)
    rows = stored_rows(routed, shared, None)
    y = torch.from_numpy(oracle(routed.float().numpy(), None, idx.numpy(), t, None).view("int16"))
    y = y.view(torch.bfloat16)
    assert _check_count(rows, idx, t, y) == 0
    off = y.clone()
    off[0, 1500] = (off[0, 1500].view(torch.int16) + 1).view(torch.bfloat16)  # one ulp
    assert _check_count(rows, idx, t, off) == 1


def test_fused_check_fails_a_y_summed_in_another_order():
    seed = seed_of("kernel-check-order")
    routed, shared, idx, t = make_case(seed)
    rows = stored_rows(routed, shared, None)
    args = (routed.float().numpy(), None, idx.numpy(), t, None)
    descending = torch.from_numpy(oracle(*args, descending=True).view("int16"))
    assert _check_count(rows, idx, t, descending.view(torch.bfloat16)) >= len(CRAFTED)
