"""The stand-in NVFP4 Mega-MoE kernel on one rank: numerics, weighted combine, layout.

Oracles in ``nvfp4_oracle`` (numpy float32/float64, ml_dtypes, exact fractions).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvfp4_cases import SHARED, build, run, stage
from nvfp4_oracle import (
    combine_base,
    combine_rows,
    dense_moe,
    resum,
    round_to_f32,
)
from nvfp4_oracle import stage as stage_oracle
from reference_oracle import BF16, bf16_values, np_bytes

from moewire.reference.nvfp4.mega_moe import shared_sf_row, weighted_combine

SHARED_IDS = list(SHARED)


def _bits(y: torch.Tensor) -> np.ndarray:
    return np_bytes(y).view(np.uint16)


def _token_rel_err(y: torch.Tensor, ref: np.ndarray) -> np.ndarray:
    got = bf16_values(y)
    return np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)


# Against the plain float64 MoE on the same staged tokens and dequantized weights. The
# kernel casts the SwiGLU output h to NVFP4: E2M1 keeps one mantissa bit, so an element's
# rounding error is at most a third of it (worst at 0.75 between 0.5 and 1) and about a
# tenth in RMS; through L2 the errors of random-sign weights add like the values do. Measured
# on these cases: at most 0.19 per token; 2^-2 bounds it. The BF16 roundings add ~2^-8.
@pytest.mark.parametrize("shared", SHARED_IDS)
@pytest.mark.parametrize("clamp", [None, 2.0], ids=["noclamp", "clamp2"])
def test_matches_float64_moe(shared, clamp):
    case = build(shared=shared, clamp=clamp, seed="f64")
    ref = dense_moe(case)
    assert _token_rel_err(case.y, ref).max() < 2.0**-2
    assert np.abs(ref).max() > 1.0


# With the kernel's rounding points redone (BF16 L1 output, NVFP4/MXFP8/BF16 L2 input, BF16
# rows), only the FP32 accumulation order inside the matmuls differs, which can flip a
# rounding near a tie: within 2^-8 per token, equal in > 99.9% of the elements.
@pytest.mark.parametrize("shared", SHARED_IDS)
def test_matches_rounding_oracle(shared):
    case = build(shared=shared, clamp=2.0, seed="rounding", l2_activation_scale=0.75)
    ref = dense_moe(case, rounding="kernel")
    assert _token_rel_err(case.y, ref).max() < 2.0**-8
    ref_bits = ref.astype(np.float32).astype(BF16).view(np.uint16)
    assert np.mean(_bits(case.y) == ref_bits) > 0.999


@pytest.mark.parametrize("shared", SHARED_IDS)
def test_rows_resummed_with_fma_equal_y_bit_for_bit(shared):
    case = build(shared=shared, t=29, tmax=500, seed="resum")
    buf = case.buf
    assert buf.num_max_tokens_per_rank == 768
    want = resum(combine_rows(buf), buf.topk_idx[:29].numpy(), buf.topk_weights[:29].numpy(),
                 29, shared != "routed")
    np.testing.assert_array_equal(want, _bits(case.y))


def _crafted():
    """Rows and weights where the FMA, the slot order and the shared position show in y.

    token 0: rows a, -a (weights 1 + 2^-20), a = 1 + 2^-7: the exact products differ by
        2^-27 from their FP32 roundings, so FMA leaves -2^-27 where mul-then-add leaves 0.
    token 1: rows 2^25, -2^25, 1 (weights 1): ascending gives 1, descending 0 (1 - 2^25
        rounds to -2^25 in FP32).
    token 2: rows 2^16, -2^16, invalid NaN slot, shared 2^-9: shared last gives 2^-9,
        shared first 0 (2^16 + 2^-9 rounds to 2^16 in FP32); the NaN row is never read.
    """
    a = 1.0 + 2.0**-7
    rows = torch.zeros((4, 3, 8), dtype=torch.bfloat16)
    rows[:, :, :] = 0
    rows[0, 0], rows[1, 0] = a, -a
    rows[0, 1], rows[1, 1], rows[2, 1] = 2.0**25, -(2.0**25), 1.0
    rows[0, 2], rows[1, 2], rows[2, 2], rows[3, 2] = 2.0**16, -(2.0**16), float("nan"), 2.0**-9
    ids = torch.tensor([[0, 1, -1], [0, 1, 2], [0, 1, -1]])
    w = torch.tensor([[1 + 2.0**-20, 1 + 2.0**-20, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return rows, ids, w


def test_weighted_combine_fma_order_and_shared_last():
    rows, ids, w = _crafted()
    y = _bits(weighted_combine(rows, ids, w, 3, shared=True))
    r, i, wn = rows.float().numpy(), ids.numpy(), w.numpy()
    np.testing.assert_array_equal(y, resum(r, i, wn, 3, True))
    assert float(bf16_values(weighted_combine(rows, ids, w, 3, shared=True))[0, 0]) == -(2.0**-27)
    # Each variant of the oracle changes y: the data separates them.
    for kwargs, token in (({"mode": "mul_add"}, 0), ({"order": "descending"}, 1),
                          ({"shared_at": "first"}, 2)):
        other = resum(r, i, wn, 3, True, **kwargs)
        assert (other[token] != y[token]).all(), kwargs


def test_fma_oracle_rounds_once():
    # 1 + 2^-24 is a tie between 1 and 1 + 2^-23: even mantissa wins.
    from fractions import Fraction

    assert round_to_f32(Fraction(1) + Fraction(1, 2**24)) == np.float32(1.0)
    assert round_to_f32(Fraction(1) + Fraction(3, 2**24)) == np.float32(1 + 2.0**-22)


def test_rows_are_unweighted():
    """Doubling-and-a-bit the router weights leaves every row as it was and changes y."""
    case = build(seed="unweighted", t=17)
    buf, t = case.buf, case.t
    rows_before = combine_rows(buf).copy()
    stage(buf, case.x, case.topk_idx, case.topk_weights * 2.5, case.weights, case.l2_alpha, 1.0)
    y2 = run(buf, case.weights, t, case.l2_alpha)
    valid = case.topk_idx.numpy() >= 0
    after = combine_rows(buf)
    for s in range(buf.num_topk):
        np.testing.assert_array_equal(after[s, :t][valid[:, s]], rows_before[s, :t][valid[:, s]])
    assert not np.array_equal(_bits(y2), _bits(case.y))


def test_alphas_scale_the_fp32_accumulators_before_bf16():
    """l2_alpha times 3 is not 3 times the BF16 row: the scaling precedes the rounding."""
    case = build(seed="alpha", t=13, mask_ratio=0.0)
    buf = case.buf
    rows1 = combine_rows(buf)[: buf.num_topk, :13].copy()
    run(buf, case.weights, 13, case.l2_alpha * 3.0)
    rows3 = combine_rows(buf)[: buf.num_topk, :13]
    rounded_after = (rows1 * 3.0).astype(np.float32).astype(BF16).astype(np.float64)
    assert np.mean(rows3 != rounded_after) > 0.05
    np.testing.assert_allclose(rows3, rows1 * 3.0, rtol=2.0**-7)


@pytest.mark.parametrize("shared", SHARED_IDS)
def test_invalid_slot_rows_stay_stale(shared):
    case = build(shared=shared, seed="stale", run_kernel=False, mask_ratio=0.4)
    buf, t = case.buf, case.t
    base = combine_base(buf)
    nbytes = buf.num_slots * buf.num_max_tokens_per_rank * buf.hidden * 2
    buf.buffer[base : base + nbytes].view(torch.int16).fill_(0x7FC1)  # BF16 NaN
    y = run(buf, case.weights, t, case.l2_alpha)
    rows = combine_rows(buf)
    valid = buf.topk_idx[:t].numpy() >= 0
    assert (~valid).any()
    for s in range(buf.num_topk):
        np.testing.assert_array_equal(~np.isnan(rows[s, :t]).any(axis=1), valid[:, s])
    assert np.isfinite(bf16_values(y)).all()
    want = resum(rows, buf.topk_idx[:t].numpy(), buf.topk_weights[:t].numpy(), t,
                 shared != "routed")
    np.testing.assert_array_equal(want, _bits(y))


@pytest.mark.parametrize("shared", SHARED_IDS)
def test_padding_tokens_get_no_routed_rows(shared):
    t = 11
    pad = torch.zeros(16, dtype=torch.bool)
    pad[[2, 5, 10]] = True
    case = build(shared=shared, seed="pad", t=t, is_padding=pad, mask_ratio=0.0)
    buf = case.buf
    ids, w = buf.topk_idx[:t], buf.topk_weights[:t]
    assert (ids[pad[:t]] == -1).all() and (w[pad[:t]] == 0).all()
    assert (ids[~pad[:t]] >= 0).all()
    y = case.y[pad[:t]]
    if shared == "routed":
        assert (y == 0).all()
    else:
        shared_rows = torch.from_numpy(combine_rows(buf)[buf.num_topk, :t]).bfloat16()
        assert torch.equal(y, shared_rows[pad[:t]])


def test_layout_combine_after_l2_scales_and_x_scales_after_combine():
    case = build(shared="mxfp8", seed="layout", t=5)
    buf = case.buf
    base = combine_base(buf)
    nbytes = buf.num_slots * buf.num_max_tokens_per_rank * buf.hidden * 2
    assert buf.x_scales.data_ptr() - buf.buffer.data_ptr() == base + nbytes
    assert buf.buffer.numel() - nbytes != base  # the tail rule is wrong for this kernel
    regions = buf._moewire_regions
    assert regions["combine"] == (base, nbytes)
    order = sorted(regions, key=lambda n: regions[n][0])
    assert order[order.index("l2_acts_sf") + 1 : order.index("l2_acts_sf") + 4] == [
        "combine", "x_scales", "l1_x_scales"
    ]
    assert list(regions).index("workspace") == 0


@pytest.mark.parametrize("t", [0, 1, 37], ids=["T0", "T1", "T37"])
def test_staging_bit_exact_to_numpy(t):
    case = build(shared="mxfp8", seed=f"stage{t}", t=t, run_kernel=False,
                 l2_activation_scale=0.375)
    buf = case.buf
    # Large and tiny tokens: per-token scales differ by orders of magnitude.
    x = case.x.float() * torch.logspace(-3, 3, max(t, 1))[:t, None]
    x = x.bfloat16()
    rows = stage(buf, x, case.topk_idx, case.topk_weights, case.weights, case.l2_alpha, 0.375)
    q, sf, scales = stage_oracle(x)
    np.testing.assert_array_equal(np_bytes(buf.x[:t]), q)
    np.testing.assert_array_equal(np_bytes(buf.x_sf[:t]), sf)
    np.testing.assert_array_equal(buf.x_scales[:t].numpy(), scales)
    g = case.weights.l2_global_scale.numpy()
    np.testing.assert_array_equal(case.l2_alpha.numpy(), g * np.float32(0.375))
    if t:
        assert rows is not None and len(set(rows.tolist())) == t
        ref = x.float().numpy().reshape(t, -1, 32)
        amax = np.maximum(np.abs(ref).max(axis=2), 1e-4) * np.float32(1 / 448)
        sf_exp = np.ceil(np.log2(amax.astype(np.float32))).astype(np.int64) + 127
        np.testing.assert_array_equal(
            np_bytes(buf.shared_l1_acts_sf[rows]).astype(np.int64), sf_exp
        )


def test_shared_sf_row_matches_vllm_formula():
    # m_in 0..127 of a 128-token page: row 4 * (m % 32) + m // 32; pages of aligned BLOCK_M.
    rows = shared_sf_row(torch.arange(256), 128)
    assert rows[:4].tolist() == [0, 4, 8, 12] and rows[32].item() == 1 and rows[33].item() == 5
    assert sorted(rows.tolist()) == list(range(256))
    rows96 = shared_sf_row(torch.arange(192), 96)
    assert rows96[96].item() == 128 and rows96.max().item() < 256


def test_debug_env_zeroes_the_buffer(monkeypatch):
    case = build(seed="debug", t=7, run_kernel=False)
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    y = run(case.buf, case.weights, 7, case.l2_alpha)
    assert (case.buf.buffer == 0).all()
    assert (y != 0).any()


def test_recv_stats_and_workspace_count_rows_per_expert():
    case = build(seed="stats", t=19, run_kernel=False)
    stats = torch.full((8,), 5, dtype=torch.int32)
    run(case.buf, case.weights, 19, case.l2_alpha, cumulative_local_expert_recv_stats=stats)
    ids = case.buf.topk_idx[:19]
    want = torch.bincount(ids[ids >= 0], minlength=8).to(torch.int32)
    assert torch.equal(stats, want + 5)
    assert torch.equal(case.buf.workspace[:8], want)
