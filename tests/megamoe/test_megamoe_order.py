"""The torch re-sum in the kernel's order, on rows where every other order gives other bits.

Routed slots ascending, the shared row first or last, an FP32 accumulator from +0.0 and
one BF16 rounding (DeepGEMM's combine): each wrong variant changes at least one crafted token (the
test asserts that of its own data), so a mutation of any of them fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import order_cases
from bitexact import assert_same_bits, seed_of
from moewire.megamoe.resum import resum
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


def _resum(rows, topk_idx, t, position, **kwargs):
    return resum(rows, topk_idx, t, shared_position=position, **kwargs)


@pytest.mark.parametrize("position", POSITIONS, ids=POSITION_IDS)
def test_resum_sums_in_the_kernel_order(position):
    seed = seed_of("resum-order", position)
    routed, shared, idx, t = make_case(seed)
    got = _resum(stored_rows(routed, shared, position), idx, t, position)
    args = (routed.float().numpy(), shared.float().numpy(), idx.numpy(), t)
    want = oracle(*args, position)
    assert_same_bits(got, want, seed=seed, what=f"resum vs oracle, shared {position}")
    for col in CRAFTED:
        assert_same_bits(got[:, col], expected_crafted(position), seed=seed, what=f"col {col}")
    for name, variant in wrong_variants(position).items():
        wrong = oracle(*args, **{"position": position, **variant})
        assert (wrong != want).any(), f"the data does not separate the kernel order from {name}"


@pytest.mark.parametrize("position", POSITIONS, ids=POSITION_IDS)
def test_resum_quantizes_routed_rows_only_in_the_kernel_order(position):
    """A row quantizer (here: rows x 2, exact) sees the routed rows, never the shared one,
    and the order still holds on the quantized rows."""
    seed = seed_of("resum-order-q", position)
    routed, shared, idx, t = make_case(seed)
    seen = []

    def double(r: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(r.shape))
        return r * 2

    got = _resum(stored_rows(routed, shared, position), idx, t, position, row_quantizer=double)
    want = oracle(
        routed.float().numpy() * 2, shared.float().numpy(), idx.numpy(), t, position
    )
    assert_same_bits(got, want, seed=seed, what=f"quantized resum, shared {position}")
    assert seen == [(routed.shape[0], t, routed.shape[2])]
    assert not torch.isnan(got).any(), "a stale NaN row leaked"
    assert np.all(want == got.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("position", POSITIONS, ids=POSITION_IDS)
def test_weighted_resum_is_an_fma_in_the_kernel_order(position):
    """``weights=`` (the NVFP4 kernel's unweighted rows): ``acc = fma(row, w, acc)``, the
    shared row with weight 1.0 in its place; mul-then-add and descending give other bits."""
    seed = seed_of("resum-fma", position)
    routed, shared, idx, weights, t = order_cases.make_weighted_case(seed)
    rows = stored_rows(routed, shared, position)
    got = _resum(rows, idx, t, position, weights=weights)
    args = (routed.float().numpy(), shared.float().numpy(), idx.numpy(), weights.numpy(), t)
    want = order_cases.weighted_oracle(*args, position)
    assert_same_bits(got, want, seed=seed, what=f"weighted resum, shared {position}")
    for col in CRAFTED[:1]:
        assert float(got[t - 1, col]) == order_cases.FMA_WANT
        assert_same_bits(got[: t - 1, col], expected_crafted(position), seed=seed, what="order")
    for wrong in ({"fma": False}, {"descending": True}):
        assert (order_cases.weighted_oracle(*args, position, **wrong) != want).any(), wrong
