"""The stand-in of DeepGEMM 2.8.0's NVFP4 x NVFP4 Mega-MoE (``fp4_fp4_mega_moe``) on one rank:
the staging, the rows, the combine and the buffer layout, against ``fp4_fp4_oracle``
(numpy float32/float64 and ml_dtypes, written from the kernel's source)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp4_fp4_cases import SMALL, buffer, build, cached_weights, run
from fp4_fp4_oracle import combine, combine_rows, dense_moe, routed_rows, stage
from reference_cases import routing, tokens
from reference_oracle import bf16_values, np_bytes

from moewire.reference import deep_gemm
from moewire.reference.fp4_fp4.mega_moe import combine as kernel_combine
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

CASES = {
    "routed": {},
    "routed-rsf": {"routed_scaling_factor": 2.5},
    "shared": {"shared": True},
    "shared-rsf-a2-clamp": {"shared": True, "routed_scaling_factor": 0.7, "a2": True,
                            "clamp": 3.0},
}


def _bits(y: torch.Tensor) -> np.ndarray:
    return np_bytes(y).view(np.uint16)


def test_staging_matches_vllm_mains_recipe_byte_for_byte():
    """vLLM main's staging (05be1d5): per 16, e4m3(max(amax / 6, 2^-9)), E2M1 of x / sf
    rounded to nearest even; ties and tiny blocks included. Break: divide by sf * 6."""
    x = tokens(40, 512, seed=3).float()
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # E2M1 ties
    x[1, :16] = 1e-6  # a scale at the 2^-9 floor
    x[2, :16] = 4000.0  # a scale above 448 saturates
    x = x.bfloat16()
    t = x.shape[0]
    packed, sf = torch.empty((t, 256), dtype=torch.uint8), torch.empty((t, 8), dtype=torch.int32)
    ids, w = routing(t, 8, 3, seed=1)
    idx, wts = torch.empty_like(ids), torch.empty_like(w)
    pad = torch.zeros(t, dtype=torch.bool)
    pad[5] = True
    prepare_megamoe_nvfp4_inputs(x, w, ids, packed, sf, idx, wts, is_padding=pad)
    want_x, want_sf = stage(x)
    assert np.array_equal(np_bytes(packed), want_x)
    assert np.array_equal(np_bytes(sf), want_sf.reshape(t, -1))
    assert (idx[5] == -1).all() and (wts[5] == 0).all()
    assert torch.equal(idx[6], ids[6]) and torch.equal(wts[6], w[6])


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_rows_match_the_rounding_oracle(name):
    """The combine rows of the valid slots, against the kernel's rounding points redone in
    float32 (alphas before the BF16 L1 rounding, the a2 requant, the L2 scale, the router
    weight after L2): only the GEMMs' summation order differs, which can flip a rounding at
    a tie: equal in > 99% of the elements, within 2^-7 per row."""
    case = build(seed=f"rows-{name}", **CASES[name])
    want = routed_rows(case)
    got = combine_rows(case.buf)[: SMALL["num_topk"], : case.t]
    valid = ~np.isnan(want[..., 0])
    assert valid.sum() > 30
    assert np.mean(got[valid] == want[valid]) > 0.99
    err = np.linalg.norm(got[valid] - want[valid], axis=-1)
    assert (err <= 2.0**-7 * np.linalg.norm(want[valid], axis=-1)).all()


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_y_is_the_combine_of_its_own_rows_bit_for_bit(name):
    """``y`` is the ascending FP32 sum of the kernel's own valid rows, finished as the
    kernel does (rounded and scaled routed sum, shared row last), read from the buffer's
    last bytes. The variants (descending order, one final rounding, shared row first) give
    other bits on these rows wherever they can differ."""
    case = build(seed=f"combine-{name}", **CASES[name])
    rows = combine_rows(case.buf)
    ids = case.topk_idx.numpy()
    shared, rsf = case.weights.shared_l1 is not None, case.routed_scaling_factor
    assert np.array_equal(combine(rows, ids, case.t, shared, rsf), _bits(case.y))
    if shared or rsf != 1.0:
        assert not np.array_equal(combine(rows, ids, case.t, shared, rsf, finish="plain"),
                                  _bits(case.y))
    if shared:
        assert not np.array_equal(combine(rows, ids, case.t, shared, rsf, shared_at="first"),
                                  _bits(case.y))


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_y_matches_the_float64_moe(name):
    """Against the MoE in float64 on the staged tokens and dequantized weights (no rounding):
    the NVFP4 requant of h dominates (E2M1 keeps one mantissa bit); 2^-2 per token bounds
    it, and the outputs are far from zero."""
    case = build(seed=f"f64-{name}", **CASES[name])
    ref = dense_moe(case)
    got = bf16_values(case.y)
    err = np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    routed = (case.topk_idx >= 0).any(dim=1).numpy()
    assert err[routed].max() < 2.0**-2
    assert np.abs(ref).max() > 1.0


def _rows(values: list[float]) -> torch.Tensor:
    """BF16 ``[slots, 1, 1]`` rows of one token and one column."""
    return torch.tensor(values, dtype=torch.float32).bfloat16().view(len(values), 1, 1)


# One token, one column, data chosen so each rule changes the bits: a and -a cancel before
# a tiny c only in ascending order; a routed sum half an ulp off a BF16 value is rounded
# before the shared row (-2^-9) is added; the factor multiplies the rounded routed sum.
@pytest.mark.parametrize(
    ("rows", "ids", "shared", "rsf", "want", "variant", "wrong"),
    [
        ([2.0**8, -(2.0**8), 2.0**-20], [0, 1, 2], False, 1.0, 2.0**-20,
         {"order": "descending"}, 0.0),
        ([1.0, 2.0**-8, 2.0**-9, -(2.0**-9)], [0, 1, 2], True, 1.0, 1.0 + 2.0**-7,
         {"finish": "plain"}, 1.0),
        ([1.0, 2.0**-8 + 2.0**-9, 0.0], [0, 1, -1], False, 3.0, 3.0 + 2.0**-5,
         {"finish": "plain"}, 3.0 + 2.0**-6),
    ],
    ids=["ascending-order", "routed-sum-rounded-before-shared", "factor-on-the-bf16-sum"],
)
def test_each_combine_rule_changes_the_result(rows, ids, shared, rsf, want, variant, wrong):
    """The kernel's combine gives ``want``; the oracle's variant without the rule gives
    ``wrong`` on the same rows. Break the order, the BF16 rounding of the routed sum, or
    where the factor applies, and one of these fails."""
    r, idx = _rows(rows), torch.tensor([ids])
    assert float(kernel_combine(r, idx, 1, shared, rsf)) == want
    bits = combine(r.float().numpy(), idx.numpy(), 1, shared, rsf, **variant)
    assert float(torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)) == wrong
    assert want != wrong


def test_the_combine_region_is_last_and_starts_where_l2_acts_sf_ends():
    """2.8.0's layout (layout/mega_moe.cuh, 0274ad7): the scale views MN-major, the shared
    views undefined (None), the combine region the buffer's last, right after l2_acts_sf."""
    buf = buffer(shared=True)
    n = buf.num_rows
    assert buf.num_max_tokens_per_rank == 1920
    assert buf.l1_acts_sf.shape == (n, 512 // 64) and buf.l1_acts_sf.stride() == (1, n)
    assert buf.l2_acts_sf.stride() == (1, n) and buf.x.dtype == torch.uint8
    assert buf.shared_l1_acts is None and buf.shared_l1_acts_sf is None
    assert buf.shared_l2_acts.dtype == torch.bfloat16 and buf.shared_l2_acts_sf is None
    end = buf.l2_acts_sf.data_ptr() + buf.l2_acts_sf.numel() * 4 - buf.buffer.data_ptr()
    combine_bytes = buf.num_slots * 1920 * 512 * 2
    assert end + combine_bytes == buf.buffer.numel()
    assert buf.combine_rows().data_ptr() - buf.buffer.data_ptr() == end


def test_invalid_slots_keep_their_stale_rows_and_stats_count():
    """Rows of masked slots are never written (a NaN poison survives); the stats count the
    rows each local expert received."""
    buf = buffer()
    weights = cached_weights(SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
                             num_shared_experts=0, seed=5, device="cpu")
    t = 17
    x = tokens(t, SMALL["hidden"], seed=9)
    ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=9)
    buf.combine_rows().view(torch.int16).fill_(0x7FC1)
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])
    stats = torch.zeros(SMALL["num_experts"], dtype=torch.int32)
    y = run(buf, weights, x, cumulative_local_expert_recv_stats=stats)
    rows = buf.combine_rows()[: SMALL["num_topk"], :t].float()
    assert torch.equal(torch.isnan(rows).all(dim=-1), (ids < 0).T)
    assert not torch.isnan(y.float()).any()
    assert torch.equal(stats, torch.bincount(ids[ids >= 0], minlength=SMALL["num_experts"])
                       .int())


def test_debug_zeroing_clears_the_buffer(monkeypatch):
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    case = build(seed="debug", t=5)
    assert not case.buf.buffer.any() and case.y.float().abs().max() > 0


def test_the_experts_module_runs_vllm_mains_forward():
    """FP4MegaMoEExperts (vLLM main's V3.2 forward) equals a direct kernel call on its
    weights; padding tokens from the forward context get no routed row."""
    from moewire.reference import forward_context
    from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts

    with deep_gemm.use_flavour("deepgemm-2.8"):
        experts = FP4MegaMoEExperts(8, 3, 512, 512, 24, device="cpu", seed=2)
        x = tokens(24, 512, seed=4)
        ids, w = routing(24, 8, 3, seed=4)
        pad = torch.zeros(24, dtype=torch.bool)
        pad[-4:] = True
        with forward_context(is_padding=pad):
            y = experts(x, w, ids)
    assert (experts.get_symm_buffer().topk_idx[20:24] == -1).all()
    assert (y[-4:] == 0).all() and y[:20].float().abs().max() > 0
