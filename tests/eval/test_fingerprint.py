"""``moewire.eval.graphs.fingerprint``: the exact checksums that compare a run's first
replayed logits with its eager forward's, against an oracle in Python integers."""

from __future__ import annotations

import pytest
import torch

from moewire.eval.graphs import fingerprint


def _oracle(logits: torch.Tensor) -> list[list[int]]:
    """The checksums in Python integers: the int16 bits times the seed-0 weights."""
    bits = logits.contiguous().view(torch.int16).tolist()
    weights = torch.randint(1, 1025, (len(bits[0]), 2), dtype=torch.float64,
                            generator=torch.Generator().manual_seed(0)).long().tolist()
    return [[sum(b * w[c] for b, w in zip(row, weights, strict=True)) for c in (0, 1)]
            for row in bits]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_checksums_equal_the_integer_oracle(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(300, 77) * 30).to(dtype)  # 300 rows: three chunks, one partial
    got = fingerprint(logits)
    assert got.dtype == torch.float64 and got.shape == (300, 2)
    assert got.long().tolist() == _oracle(logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_ulp_anywhere_changes_both_checksums_of_its_row(dtype):
    """Break: checksum the values instead of their bits (a float sum rounds a 1-ulp change
    of one logit among large ones away), or drop a chunk's rows."""
    torch.manual_seed(1)
    logits = (torch.randn(200, 4099) * 1e4).to(dtype)
    logits[:, 0] = 3e38  # large values beside small ones
    base = fingerprint(logits)
    for t, v in [(0, 5), (137, 4098), (199, 1)]:
        changed = logits.clone()
        changed[t, v] = torch.nextafter(changed[t, v].float(),
                                        torch.tensor(float("inf"))).to(dtype)
        if changed[t, v] == logits[t, v]:  # BF16: step the bits
            changed.view(torch.int16)[t, v] += 1
        diff = fingerprint(changed) != base
        assert diff[t].all() and diff.sum() == 2


def test_a_nan_payload_and_a_sign_of_zero_count():
    logits = torch.zeros(2, 8, dtype=torch.bfloat16)
    other = logits.clone()
    other[1, 3] = -0.0
    assert not torch.equal(fingerprint(other), fingerprint(logits))
    nan = logits.clone()
    nan[0, 0] = float("nan")
    nan2 = nan.clone()
    nan2.view(torch.int16)[0, 0] += 1  # another NaN
    assert torch.isnan(nan2[0, 0])
    assert not torch.equal(fingerprint(nan2), fingerprint(nan))
    assert torch.equal(fingerprint(nan), fingerprint(nan.clone()))


@pytest.mark.parametrize(("logits", "match"), [
    (torch.zeros(4), r"\[T, V\]"),
    (torch.zeros(2, 3, dtype=torch.float64), "16- or 32-bit"),
    (torch.zeros(1, 2**18 + 1), r"exceed 2\^19"),
], ids=["1-d", "float64", "too-wide"])
def test_inputs_it_cannot_checksum_exactly_are_refused(logits, match):
    with pytest.raises(ValueError, match=match):
        fingerprint(logits)
