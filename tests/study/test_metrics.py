"""The error metrics against hand math and a float64 oracle written out in numpy."""

import math

import numpy as np
import pytest
import torch

from moewire import formats
from moewire.study.metrics import error_metrics


def test_hand_computed_case():
    # ref = [1, 2, 2] (norm 3), y = ref + [0, 0, 3]: error norm 3, so rel L2 = 1 and
    # SQNR = 10 log10(9 / 9) = 0 dB; <y, r> = 1 + 4 + 10 = 15, |y| = sqrt(30).
    ref = torch.tensor([[1.0, 2.0, 2.0]])
    y = torch.tensor([[1.0, 2.0, 5.0]])
    m = error_metrics(y, ref)
    assert m.rel_l2 == 1.0
    assert m.sqnr_db == 0.0
    assert m.cosine == pytest.approx(15.0 / (3.0 * math.sqrt(30.0)), rel=1e-15)
    assert m.max_abs_err == 3.0


def test_against_float64_oracle_on_random_data():
    g = torch.Generator().manual_seed(7)
    ref = (torch.randn(37, 256, generator=g) * 3).bfloat16()
    y = (ref.float() + 0.05 * torch.randn(37, 256, generator=g)).bfloat16()
    r, q = ref.float().numpy().astype(np.float64), y.float().numpy().astype(np.float64)
    err = q - r
    want_rel = np.linalg.norm(err) / np.linalg.norm(r)
    want_sqnr = 10 * np.log10(np.sum(r * r) / np.sum(err * err))
    want_cos = np.dot(q.ravel(), r.ravel()) / (np.linalg.norm(q) * np.linalg.norm(r))
    m = error_metrics(y, ref)
    assert m.rel_l2 == pytest.approx(want_rel, rel=1e-12)
    assert m.sqnr_db == pytest.approx(want_sqnr, rel=1e-12)
    assert m.cosine == pytest.approx(want_cos, rel=1e-12)
    assert m.max_abs_err == np.abs(err).max()
    assert 0 < m.rel_l2 < 0.1 and m.sqnr_db > 20


def test_identical_outputs_are_exact():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(16, 128, generator=g).bfloat16()
    m = error_metrics(ref.clone(), ref)
    assert (m.rel_l2, m.sqnr_db, m.cosine, m.max_abs_err) == (0.0, math.inf, 1.0, 0.0)


def test_bf16_format_gives_zero_error():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(8, 512, generator=g) * 10).bfloat16()
    m = error_metrics(formats.get("bf16").qdq(x), x)
    assert m.rel_l2 == 0.0 and m.sqnr_db == math.inf and m.max_abs_err == 0.0


@pytest.mark.parametrize(
    "ref, y, want",
    [
        ([0.0, 0.0], [0.0, 0.0], (0.0, math.inf, 1.0, 0.0)),
        ([0.0, 0.0], [0.0, 2.0], (math.inf, -math.inf, 0.0, 2.0)),
        ([1.0, 0.0], [0.0, 0.0], (1.0, 0.0, 0.0, 1.0)),
    ],
    ids=["both-zero", "zero-reference", "zero-output"],
)
def test_degenerate_references(ref, y, want):
    m = error_metrics(torch.tensor(y), torch.tensor(ref))
    assert (m.rel_l2, m.sqnr_db, m.cosine, m.max_abs_err) == want


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "mxfp8", "mxfp4", "fp8_b32_ue8m0"])
def test_format_applied_twice_with_a_fixed_scale_gives_the_same_error(name):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 512, generator=g) * torch.exp(torch.randn(64, 1, generator=g)))
    x = x.bfloat16()
    fmt = formats.get(name)
    amax = x.abs().amax().float() if fmt.needs_amax else None
    once = fmt.qdq(x, amax)
    twice = fmt.qdq(once, amax)
    first, second = error_metrics(once, x), error_metrics(twice, x)
    assert first == second
    assert first.rel_l2 > 0


@pytest.mark.parametrize(
    "y, ref, exc",
    [
        (torch.zeros(2, 3), torch.zeros(3, 2), ValueError),
        (torch.zeros(0, 4), torch.zeros(0, 4), ValueError),
        ([1.0], torch.zeros(1), TypeError),
    ],
    ids=["shape-mismatch", "empty", "not-a-tensor"],
)
def test_refusals(y, ref, exc):
    with pytest.raises(exc, match="error_metrics"):
        error_metrics(y, ref)
