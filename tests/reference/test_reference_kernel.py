"""The stand-in Mega-MoE kernel on one rank: numerics, combine rows, layout, refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import reference_oracle as O
import torch
from reference_cases import build, run_kernel

from moewire.reference import builds, deep_gemm, make_weights, stage_mega_moe_inputs

FLAVOUR_SHARED = [
    ("deepgemm-main", 0), ("vllm-0.32", 0), ("vllm-0.32", 1), ("vllm-0.33", 0), ("vllm-0.33", 1),
    ("deepgemm-sm90", 0),
]
FS_IDS = [f"{f}-shared{s}" for f, s in FLAVOUR_SHARED]
# (flavour, shared, mma) that a build has: deepgemm-sm90 has no bf16 kernel.
FLAVOUR_SHARED_MMA = [
    (f, s, m) for f, s in FLAVOUR_SHARED for m in ("fp8xfp4", "bf16xbf16")
    if m in deep_gemm.KERNEL_BUILDS[f].mma_types
]
FSM_IDS = [f"{f}-shared{s}-{m}" for f, s, m in FLAVOUR_SHARED_MMA]


def _oracle_inputs(case):
    t = case.x.shape[0]
    w, shared = case.weights, None
    if w.shared_l1 is not None:
        shared = (O.dequantize(w.shared_l1_raw), O.dequantize(w.shared_l2_raw))
    return (
        O.staged_tokens(case.buf, t),
        case.topk_idx.numpy(),
        case.topk_weights.numpy().astype(np.float64),
        O.dequantize(case.weights.l1_raw),
        O.dequantize(case.weights.l2_raw),
        shared,
    )


def _token_rel_err(y: torch.Tensor, ref: np.ndarray) -> np.ndarray:
    got = O.bf16_values(y)
    norm = np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    return np.linalg.norm(got - ref, axis=1) / norm


# The kernel against a plain float64 MoE on the same staged tokens and dequantized weights.
# fp8xfp4: h is re-quantized to E4M3 (3 mantissa bits): each element's rounding error is at
# most 2^-4 of it (half an ulp), and through L2 the errors of random-sign weights add up
# like the values do, so a token's relative L2 error stays below 2^-4 (measured ~0.03; the
# BF16 roundings of the L1 output, the rows and y add at most 3 * 2^-9). bf16xbf16: h is
# rounded to BF16, so 2^-7 covers the four BF16 roundings with margin.
@pytest.mark.parametrize("mma,bound", [("fp8xfp4", 2.0**-4), ("bf16xbf16", 2.0**-7)],
                         ids=["fp8xfp4", "bf16xbf16"])
@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "fused-shared"])
@pytest.mark.parametrize("clamp", [None, 1.5], ids=["noclamp", "clamp1.5"])
def test_matches_float64_moe(mma, bound, shared, clamp):
    case = build(mma=mma, shared=shared, clamp=clamp, seed=3)
    ref = O.dense_moe(*_oracle_inputs(case), clamp=clamp)
    err = _token_rel_err(case.y, ref)
    assert err.max() < bound, err.max()
    assert np.abs(ref).max() > 1.0  # the case is not trivially small


# With the kernel's rounding points redone in float64 + ml_dtypes, the only difference left
# is the FP32 accumulation order inside the matmuls, which can flip a rounding near a tie:
# y equals the oracle's BF16 y in > 99% of elements, and within one BF16 ulp (2^-8) per token.
@pytest.mark.parametrize("mma", ["fp8xfp4", "bf16xbf16"])
@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "fused-shared"])
def test_matches_rounding_oracle(mma, shared):
    case = build(mma=mma, shared=shared, clamp=2.0, seed=4)
    rounding = "fp8" if mma == "fp8xfp4" else "bf16"
    ref = O.dense_moe(*_oracle_inputs(case), clamp=2.0, rounding=rounding)
    assert _token_rel_err(case.y, ref).max() < 2.0**-8
    ref_bits = ref.astype(np.float32).astype(O.BF16).view(np.uint16)
    assert np.mean(O.np_bytes(case.y).view(np.uint16) == ref_bits) > 0.99


@pytest.mark.parametrize("flavour,shared,mma", FLAVOUR_SHARED_MMA, ids=FSM_IDS)
def test_resum_of_combine_rows_equals_y_bit_for_bit(flavour, shared, mma):
    case = build(flavour=flavour, shared=shared, mma=mma, t=29, tmax=500, seed=5)
    assert case.buf.num_max_tokens_per_rank == 768
    bits = O.np_bytes(case.y).view(np.uint16)
    np.testing.assert_array_equal(O.resum(case.buf, case.topk_idx.numpy(), 29), bits)


@pytest.mark.parametrize("flavour,shared", FLAVOUR_SHARED, ids=FS_IDS)
def test_invalid_slot_rows_stay_stale(flavour, shared):
    case = build(flavour=flavour, shared=shared, t=31, mask_ratio=0.35, seed=6, run=False)
    buf = case.buf
    base = O.combine_base(buf)
    num_slots = buf.num_topk + (1 if shared else 0)
    nbytes = num_slots * buf.num_max_tokens_per_rank * buf.hidden * 2
    region = buf.buffer[base : base + nbytes].view(torch.int16)
    region.fill_(0x7FC1)  # a BF16 quiet NaN
    before_l2 = buf.l2_acts.view(torch.uint8).clone()
    y = run_kernel(buf, case.weights, 31)
    assert not torch.isnan(y).any()
    rows = O.combine_rows(buf)
    idx = case.topk_idx.numpy()
    for s in range(buf.num_topk):
        written = ~np.isnan(rows[s]).any(axis=1)
        np.testing.assert_array_equal(written[:31], idx[:, s] >= 0)
        assert np.isnan(rows[s, 31:]).all()  # tokens beyond T are never written
    if shared:  # stored at slot k in every build, for every token
        assert not np.isnan(rows[buf.num_topk, :31]).any()
    assert (idx < 0).any() and not torch.equal(before_l2, buf.l2_acts.view(torch.uint8))


def test_stale_rows_from_an_earlier_call_survive():
    case = build(t=20, mask_ratio=0.0, seed=7)
    first_rows = O.combine_rows(case.buf).copy()
    ids = case.topk_idx.clone()
    ids[:, 1] = -1
    stage_mega_moe_inputs(case.x, ids, case.topk_weights, case.buf)
    y = run_kernel(case.buf, case.weights, 20)
    np.testing.assert_array_equal(O.combine_rows(case.buf)[1, :20], first_rows[1, :20])
    bits = O.np_bytes(y).view(np.uint16)
    np.testing.assert_array_equal(O.resum(case.buf, ids.numpy(), 20), bits)
    assert not np.array_equal(bits, O.np_bytes(case.y).view(np.uint16))


def test_token_with_no_valid_slot_gets_zero_and_zero_tokens_run():
    case = build(t=12, seed=8, run=False)
    ids = case.topk_idx.clone()
    ids[[2, 9]] = -1
    stage_mega_moe_inputs(case.x, ids, case.topk_weights, case.buf)
    y = run_kernel(case.buf, case.weights, 12)
    assert (y[[2, 9]] == 0).all() and not (y[[2, 9]].view(torch.int16) < 0).any()  # +0.0
    assert (y[0] != 0).any()
    empty = run_kernel(case.buf, case.weights, 0)
    assert empty.shape == (0, 512)


def test_debug_env_zeroes_the_whole_buffer(monkeypatch):
    case = build(t=16, seed=9, run=False)
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    y = run_kernel(case.buf, case.weights, 16)
    assert (y != 0).any()
    assert not case.buf.buffer.any()


def test_recv_stats_count_rows_per_local_expert():
    case = build(t=25, seed=10, run=False)
    stats = torch.full((8,), 3, dtype=torch.int32)
    y = torch.empty((25, 512), dtype=torch.bfloat16)
    deep_gemm.fp8_fp4_mega_moe(
        y, case.weights.l1, case.weights.l2, case.buf, cumulative_local_expert_recv_stats=stats
    )
    ids = case.topk_idx[case.topk_idx >= 0]
    assert torch.equal(stats, 3 + torch.bincount(ids, minlength=8).int())


def test_weight_cache_sees_in_place_updates():
    case = build(t=10, seed=11, cache_weights=False)
    case.weights.l2[0].mul_(0).add_(17)  # FP4 code 1 (0.5) low, 1 high: changes every value
    stage_mega_moe_inputs(case.x, case.topk_idx, case.topk_weights, case.buf)
    assert not torch.equal(run_kernel(case.buf, case.weights, 10), case.y)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("flavour,shared,mma", FLAVOUR_SHARED_MMA, ids=FSM_IDS)
def test_buffer_views_and_combine_base(flavour, shared, mma):
    with deep_gemm.use_flavour(flavour):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, 8, 100, 4, 512, 1024, num_shared_experts=shared, mma_type=mma, device="cpu"
        )
    tmax, fp8 = 384, mma == "fp8xfp4"
    assert buf.num_max_tokens_per_rank == tmax and buf._moewire_flavour == flavour
    assert buf.buffer.dtype == torch.int8 and buf.buffer.dim() == 1
    act = torch.float8_e4m3fn if fp8 else torch.bfloat16
    assert (buf.x.dtype, tuple(buf.x.shape)) == (act, (tmax, 512))
    if fp8:
        assert (buf.x_sf.dtype, tuple(buf.x_sf.shape)) == (torch.int32, (tmax, 4))
        assert tuple(buf.l2_acts_sf.shape) == (tmax * 4, 8)
    else:
        assert buf.x_sf is None and buf.l1_acts_sf is None and buf.l2_acts_sf is None
    assert (buf.topk_idx.dtype, tuple(buf.topk_idx.shape)) == (torch.int64, (tmax, 4))
    assert (buf.topk_weights.dtype, tuple(buf.topk_weights.shape)) == (torch.float32, (tmax, 4))
    assert buf.l2_acts.shape[1] == 1024 and buf.l1_acts.shape[1] == 512
    for field in ("group", "num_experts", "num_topk", "hidden", "intermediate_hidden"):
        assert hasattr(buf, field)
    combine = (4 + shared) * tmax * 512 * 2
    last = buf.buffer.numel() - combine
    view = buf.l2_acts_sf if fp8 else buf.l2_acts
    end_of_sf = view.data_ptr() + view.numel() * view.element_size() - buf.buffer.data_ptr()
    if flavour == "vllm-0.33" and not fp8:
        # combine_norm_buffer follows the combine region: the tail rule is wrong here.
        assert end_of_sf == last - 4 * tmax * (512 // 128) * 4
    else:
        assert end_of_sf == last
    shares = buf.l2_acts.untyped_storage().data_ptr() == buf.buffer.untyped_storage().data_ptr()
    assert shares == (flavour != "deepgemm-sm90")  # the SM90 build's views are DLPack


def test_use_flavour_setter_context_and_env(monkeypatch):
    monkeypatch.delenv(deep_gemm.ENV_FLAVOUR, raising=False)
    monkeypatch.setattr(builds, "_flavour_setting", None)
    assert deep_gemm.current_flavour() == "vllm-0.33"
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "deepgemm-sm90")
    assert deep_gemm.current_flavour() == "deepgemm-sm90"
    with deep_gemm.use_flavour("deepgemm-main"):
        assert deep_gemm.current_flavour() == "deepgemm-main"
        with deep_gemm.use_flavour("vllm-0.32"):
            assert deep_gemm.current_flavour() == "vllm-0.32"
        assert deep_gemm.current_flavour() == "deepgemm-main"
    assert deep_gemm.current_flavour() == "deepgemm-sm90"
    deep_gemm.use_flavour("deepgemm-main")
    assert deep_gemm.current_flavour() == "deepgemm-main"


# ----------------------------------------------------------------------------- casts


def test_per_token_cast_to_fp8_matches_deepgemm_semantics():
    x = torch.randn(6, 200, dtype=torch.bfloat16) * 3
    x[0, :32] = 0  # an all-zero group takes the 1e-4 floor
    q, sf = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32)
    xs = O.bf16_values(x)
    padded = np.zeros((6, 224))
    padded[:, :200] = xs
    amax = np.maximum(np.abs(padded.reshape(6, 7, 32)).max(-1), 1e-4)
    ref_sf = np.exp2(np.ceil(np.log2(amax / 448.0)))
    np.testing.assert_array_equal(sf.numpy(), ref_sf)
    ref_q = (padded.reshape(6, 7, 32) / ref_sf[..., None]).reshape(6, 224)[:, :200]
    np.testing.assert_array_equal(O.fp8_values(q), ref_q.astype(O.E4M3).astype(np.float64))
    q2, sf2 = deep_gemm.per_token_cast_to_fp8(x[:, :128], use_ue8m0=False)
    # amax / 448 as torch evaluates it on CUDA, where DeepGEMM runs: a * fl32(1/448).
    amax2 = np.maximum(np.abs(xs[:, :128]).max(-1), 1e-4).astype(np.float32)
    ref_sf2 = amax2 * (np.float32(1) / np.float32(448))
    np.testing.assert_array_equal(sf2.numpy()[:, 0], ref_sf2)
    packed = deep_gemm.per_token_cast_to_fp8(x[:, :128], True, 32, use_packed_ue8m0=True)[1]
    assert packed.dtype == torch.int32 and packed.shape == (6, 1)
    ref128 = np.maximum(np.abs(xs[:, :128].reshape(6, 4, 32)).max(-1), 1e-4)
    np.testing.assert_array_equal(
        O.ue8m0_scales(packed), np.exp2(np.ceil(np.log2(ref128 / 448.0)))
    )


def test_staging_pads_and_writes_the_first_t_rows():
    case = build(t=9, seed=12, run=False)
    pad = torch.zeros(16, dtype=torch.bool)
    pad[[1, 4]] = True
    before = case.buf.topk_idx[9:].clone()
    stage_mega_moe_inputs(case.x, case.topk_idx, case.topk_weights, case.buf, pad)
    assert (case.buf.topk_idx[[1, 4]] == -1).all() and (case.buf.topk_weights[[1, 4]] == 0).all()
    keep = [0, 2, 3, 5, 6, 7, 8]
    assert torch.equal(case.buf.topk_idx[keep], case.topk_idx[keep])
    assert torch.equal(case.buf.topk_idx[9:], before)
    q, sf = deep_gemm.per_token_cast_to_fp8(case.x, True, 32, True)
    assert torch.equal(case.buf.x[:9].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(case.buf.x_sf[:9], sf)


def test_fp4_weights_decode_to_the_dense_weights_within_e2m1_rounding():
    w = make_weights(2, 512, 512, seed=13, outlier_channels=0)
    dense = O.dequantize(w.l1_raw)
    gen = torch.Generator().manual_seed((13 * 1000003 + 1) * 2)
    truth = torch.randn((1024, 512), generator=gen).double().numpy() / 512**0.5
    # E2M1 has one mantissa bit: relative rounding error <= 1/3 (between 4 and 6) per
    # element above the group's smallest normal; a group's scale is at most 2x its amax/6.
    groups = np.abs(truth.reshape(1024, 16, 32)).max(-1, keepdims=True)
    err = np.abs(dense[1] - truth).reshape(1024, 16, 32)
    assert (err <= np.maximum(np.abs(truth.reshape(1024, 16, 32)) / 3, groups / 6 / 2)).all()


def test_transform_does_upstreams_permutations():
    n, k = 256, 512  # 2I = 256 rows (I = 128), K = 512
    rows = torch.arange(n, dtype=torch.int32)
    w = rows.view(1, n, 1).expand(2, n, k // 2).to(torch.int8).contiguous()
    sf = rows.view(1, n, 1).expand(2, n, k // 128).contiguous()
    (tw, tsf), (w2, sf2) = deep_gemm.transform_weights_for_mega_moe((w, sf), (w, sf))
    interleaved = [b * 8 + j + (n // 2 if half else 0)
                   for b in range(n // 16) for half in (0, 1) for j in range(8)]
    assert tw[0, :, 0].tolist() == [r - 256 if r > 127 else r for r in interleaved]
    utccp = [blk * 128 + 32 * q + r for blk in range(n // 128) for r in range(32)
             for q in range(4)]
    assert tsf[1, :, 0].tolist() == [interleaved[i] for i in utccp]
    assert torch.equal(w2, w) and sf2[0, :, 0].tolist() == utccp


# ----------------------------------------------------------------------------- SiTU


@pytest.mark.parametrize("mma", ["fp8xfp4", "bf16xbf16"])
@pytest.mark.parametrize("beta", [0.0, 1.5], ids=["beta0-up-unscaled", "beta1.5"])
def test_situ_matches_the_rounding_oracle(mma, beta):
    # Kimi-K3's activation (vLLM 0.34's SiTU): alpha * tanh(g / alpha) * sigmoid(g) * up', with
    # up' = beta * tanh(up / beta) for beta > 0; 2.5 keeps tanh away from its linear part.
    alpha, shared, t = 2.5, 1, 37
    case = build(mma=mma, shared=shared, seed=40, run=False)
    with deep_gemm.use_flavour("vllm-0.32"):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, case.buf.num_experts, t, case.buf.num_topk, case.buf.hidden,
            case.buf.intermediate_hidden, num_shared_experts=shared, mma_type=mma,
            activation="situ", device="cpu",
        )
    stage_mega_moe_inputs(case.x, case.topk_idx, case.topk_weights, buf)
    y = torch.empty((t, buf.hidden), dtype=torch.bfloat16)
    w = case.weights
    getattr(deep_gemm, "fp8_fp4_mega_moe" if mma == "fp8xfp4" else "bf16_mega_moe")(
        y, w.l1, w.l2, buf, shared_l1_weights=w.shared_l1, shared_l2_weights=w.shared_l2,
        activation="situ", activation_alpha=alpha, activation_beta=beta,
    )
    inputs = _oracle_inputs(dataclasses.replace(case, buf=buf))
    rounding = "fp8" if mma == "fp8xfp4" else "bf16"
    ref = O.dense_moe(*inputs, rounding=rounding, situ=(alpha, beta))
    assert _token_rel_err(y, ref).max() < 2.0**-8
    swiglu = O.dense_moe(*inputs, rounding=rounding)
    assert _token_rel_err(y, swiglu).max() > 2.0**-4  # SiTU is not SwiGLU on this data
    np.testing.assert_array_equal(O.resum(buf, case.topk_idx.numpy(), t),
                                  O.np_bytes(y).view(np.uint16))


def test_situ_refuses_a_clamp():
    with deep_gemm.use_flavour("vllm-0.32"):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, 8, 4, 2, 512, 512, mma_type="bf16xbf16", activation="situ", device="cpu"
        )
    w = make_weights(8, 512, 512, mma_type="bf16xbf16", seed=1)
    y = torch.empty((4, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="situ takes no activation_clamp"):
        deep_gemm.bf16_mega_moe(y, w.l1, w.l2, buf, activation="situ", activation_clamp=3.0)
