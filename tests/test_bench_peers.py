"""The benchmarks' compile peer (benchmarks/_peers.py) computes resum's bits.

The peer is timed against the fused kernel, so it must be the same arithmetic: the QDQ
of the format's reference, then resum's FP32 sum (from +0, slots ascending, the shared
row first or last, invalid slots *selected* away, one BF16 rounding), compiled with static
shapes. The rows come from ``order_cases``: their crafted columns give other bits in any
other summation order, invalid slots hold stale NaN rows (a multiply by a 0/1 mask lets
the NaN through), and one column of a token is -0.0 in every row (Inductor folds the
``0 + x`` of the first add, which keeps a -0.0 that resum's +0.0 start drops).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import order_cases
from moewire import formats
from moewire.megamoe.resum import resum

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_peers.py"
_SPEC = importlib.util.spec_from_file_location("bench_peers", _PATH)
peers = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_peers"] = peers  # dynamo looks the traced function's module up there
_SPEC.loader.exec_module(peers)

HIDDEN = 256
NEG_ZERO_COL = 200  # outside the crafted column's 128-column block


def _case(position):
    routed, shared, idx, t = order_cases.make_case(seed=3, hidden=HIDDEN)
    routed, shared, idx = routed[:, :t].clone(), shared[:t].clone(), idx[:t]
    routed[:, 1, NEG_ZERO_COL] = -0.0  # token 1: every slot valid
    shared[1, NEG_ZERO_COL] = -0.0
    rows = routed if position is None else torch.cat([routed, shared[None]])
    return rows, idx, t


def _amax(fmt, rows):
    if not formats.get(fmt).needs_amax:
        return None
    return rows.float().nan_to_num(0.0).abs().amax().reshape(())


def _want(fmt, rows, idx, t, position, amax):
    ref = formats.get(fmt)
    return resum(rows, idx, t, shared_position=position,
                 row_quantizer=lambda x: ref.reference(x, amax))


def _bits(x):
    return x.view(torch.int16)


@pytest.mark.parametrize("position", order_cases.POSITIONS, ids=order_cases.POSITION_IDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_eager_peer_equals_resum(fmt, position):
    rows, idx, t = _case(position)
    amax = _amax(fmt, rows)
    got = peers.peer_combine(rows, idx, amax, fmt=fmt, shared_position=position)
    assert torch.equal(_bits(got), _bits(_want(fmt, rows, idx, t, position, amax)))


def test_the_case_separates_orders_nan_and_signed_zero():
    """The data can fail: the crafted column is the hand-derived sum, stale rows are NaN,
    and the -0.0 column is -0.0 in every routed and shared row."""
    rows, idx, t = _case("last")
    y = _want("bf16", rows, idx, t, "last", None)
    assert torch.equal(y[:, order_cases.CRAFTED[0]], order_cases.expected_crafted("last"))
    assert rows[:4][(idx < 0).t()].isnan().all()
    assert (rows[:, 1, NEG_ZERO_COL].view(torch.int16) == -(2**15)).all()
    assert _bits(y[1, NEG_ZERO_COL]) == 0  # resum's +0.0 start


def _compiled_equals_resum(fmt, position, numerics):
    rows, idx, t = _case(position)
    amax = _amax(fmt, rows)
    want = _want(fmt, rows, idx, t, position, amax)
    comp, record = peers.check_compiled(
        peers.combine_peer(fmt, position), peers.default_mode("cpu"), numerics,
        [((rows, idx, amax), want)], f"test {fmt} {position}")
    assert record["compile_exact"], record
    assert torch.equal(_bits(comp(rows, idx, amax)), _bits(want))
    return record


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_compiled_peer_equals_resum(fmt):
    """One static compile on CPU with eager numerics: every bit of resum, shared row last."""
    record = _compiled_equals_resum(fmt, "last", "eager")
    assert record["compile_numerics"] == "eager"


@pytest.mark.slow
@pytest.mark.parametrize("position", order_cases.POSITIONS, ids=order_cases.POSITION_IDS)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_compiled_peer_auto_numerics_equals_resum(fmt, position):
    """As the benchmark compiles it: Inductor's numerics, or eager ones where those differ."""
    _compiled_equals_resum(fmt, position, "auto")


@pytest.mark.slow
def test_compiled_qdq_peer_equals_reference():
    x = (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    amax = x.float().abs().amax().reshape(())
    want = formats.get("nvfp4").reference(x, amax)
    _, record = peers.check_compiled(peers.qdq_peer("nvfp4"), "default", "auto",
                                     [((x, amax), want)], "test qdq")
    assert record["compile_exact"], record


def test_stale_nan_case_leaves_its_inputs_alone():
    rows = torch.randn(3, 10, 16).bfloat16()
    idx = torch.randint(0, 8, (10, 3))
    nan_rows, nan_idx = peers.stale_nan_case(rows, idx, every=4)
    assert not rows.isnan().any() and (idx >= 0).all()
    stale = nan_idx < 0
    assert stale.sum() == 8  # 30 (token, slot) pairs, every 4th
    assert nan_rows[stale.t()].isnan().all() and not nan_rows[~stale.t()].isnan().any()


@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        (peers.compile_peer, (peers.peer_qdq, "default", "auto"),
         "compile_peer: numerics must be 'inductor' or 'eager'"),
        (peers.check_compiled, (peers.peer_qdq, "default", "fast", [], "x"),
         "check_compiled: numerics must be one of"),
    ],
    ids=["compile_peer-auto", "check_compiled-unknown"],
)
def test_unknown_numerics_is_refused(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)
