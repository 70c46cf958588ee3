"""The stand-in of sgl-deep-gemm's ``mega_moe_pre_dispatch_sm90`` against an independent
oracle: NumPy FP32 arithmetic and ml_dtypes' E4M3 rounding, on data with ties, an all-zero
group, a group whose scaled values saturate, padding rows and a routed scaling factor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from moewire.reference.sgl_staging import mega_moe_pre_dispatch_sm90

TMAX, H, K = 8, 384, 3


def oracle(x: np.ndarray, rsf: float, w: np.ndarray):
    """x FP32 [T, H] (BF16 values); per group of 128: sf = fp32(max(amax, 1e-10) / 448),
    q = e4m3_rne(clip(fp32(x * fp32(1 / sf)), +-448))."""
    t = x.shape[0]
    g = x.reshape(t, H // 128, 128).astype(np.float32)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-10)).astype(np.float32)
    sf = (amax / np.float32(448.0)).astype(np.float32)
    inv = (np.float32(1.0) / sf).astype(np.float32)
    scaled = np.clip((g * inv[..., None]).astype(np.float32), -448, 448)
    q = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(t, H)
    return q, sf, (w.astype(np.float32) * np.float32(rsf)).astype(np.float32)


def data(t: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, H, generator=g).bfloat16()
    x[0, :128] = 0  # all-zero group
    # A group with amax 448: x * inv == x exactly; 17 and 19 are ties in E4M3 (16, 18, 20
    # representable at exponent 4), which RNE rounds to even mantissas: 16 and 20.
    x[1, 128:256] = 1.0
    x[1, 128] = 448.0
    x[1, 129], x[1, 130], x[1, 131] = 17.0, 19.0, -17.0
    # amax 2.15625: fp32(1 / fp32(amax / 448)) is one ulp off fp32(448 / amax), and
    # 1.6171875 * inv lies on the 320/352 tie, so the order of the two divisions shows.
    x[2, 256:] = 0.5
    x[2, 256], x[2, 257] = 2.15625, 1.6171875
    ids = torch.randint(-1, 8, (t, K), generator=g, dtype=torch.int32)
    w = torch.rand(t, K, generator=g)
    return x, ids, w


def buffers():
    return (torch.full((TMAX, H), float("nan")).to(torch.float8_e4m3fn),
            torch.full((TMAX, H // 128), -7.0), torch.full((TMAX, K), 5, dtype=torch.int64),
            torch.full((TMAX, K), -3.0))


@pytest.mark.parametrize("rsf", [1.0, 2.5, 0.1], ids=["rsf-1", "rsf-2.5", "rsf-0.1"])
def test_matches_the_oracle(rsf):
    t = 5
    x, ids, w = data(t)
    bx, bsf, bidx, bw = buffers()
    mega_moe_pre_dispatch_sm90(x, ids, w, bx, bsf, bidx, bw, num_tokens=t,
                               routed_scaling_factor=rsf)
    q, sf, w_want = oracle(x.float().numpy(), rsf, w.numpy())
    np.testing.assert_array_equal(bx[:t].float().numpy(), q)
    np.testing.assert_array_equal(bsf[:t].numpy(), sf)
    np.testing.assert_array_equal(bw[:t].numpy(), w_want)
    assert torch.equal(bidx[:t], ids.long())
    assert bx[1, 129].float() == 16 and bx[1, 130].float() == 20 and bx[1, 131].float() == -16
    assert bx[2, 257].float() == 352
    assert bsf[0, 0] == np.float32(np.float32(1e-10) / np.float32(448))
    # Padding rows: no valid slot, weight 0; x and x_sf of those rows are left alone.
    assert (bidx[t:] == -1).all() and (bw[t:] == 0).all()
    assert bx[t:].float().isnan().all() and (bsf[t:] == -7).all()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"group_size": 32}, "group_size must be 128"),
        ({"num_tokens": TMAX + 1}, "num_tokens"),
        ({"topk_idx": "int64"}, "topk_idx must be torch.int32"),
        ({"x": "fp32"}, "x must be torch.bfloat16"),
    ],
    ids=["group-size", "too-many-tokens", "int64-ids", "fp32-x"],
)
def test_refuses(change, match):
    x, ids, w = data(TMAX)
    kwargs = {"group_size": 128, "num_tokens": 4}
    if change.get("topk_idx") == "int64":
        ids = ids.long()
    elif change.get("x") == "fp32":
        x = x.float()
    else:
        kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        mega_moe_pre_dispatch_sm90(x, ids, w, *buffers(), **kwargs)


# -- SM100: mega_moe_pre_dispatch ---------------------------------------------------------------

E2M1 = ml_dtypes.float4_e2m1fn


def _e2m1_oracle(v: np.ndarray) -> np.ndarray:
    """E2M1 codes by ml_dtypes' RNE cast (saturating at 6), negative zero as +0."""
    codes = np.clip(v, -6, 6).astype(E2M1).view(np.uint8) & 0xF
    return np.where((codes & 0x7) == 0, 0, codes).astype(np.uint8)


def _ue8m0_oracle(raw: np.ndarray) -> np.ndarray:
    """The byte of the smallest power of two >= raw, from frexp (raw = m 2^e, m in [.5, 1))."""
    m, e = np.frexp(raw.astype(np.float64))
    exp = np.where(m == 0.5, e - 1, e) + 127
    return np.clip(exp, 1, 254).astype(np.int64)


def sm100_oracle(x: np.ndarray, mma: str, gs: int):
    """(codes or FP8 values, scale bytes, per-token scales) for FP32 ``x`` [T, H]."""
    t, h = x.shape
    g = x.reshape(t, h // gs, gs).astype(np.float32)
    gmax = np.abs(g).max(-1)
    pts = None
    if mma == "nvfp4xnvfp4":
        pts = (np.maximum(gmax.max(-1, keepdims=True), np.float32(1e-4))
               / np.float32(2688)).astype(np.float32)
        sf = np.clip((gmax / (np.float32(6) * pts)).astype(np.float32), -448, 448).astype(
            ml_dtypes.float8_e4m3fn)
        dec = (sf.astype(np.float32) * pts).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(sf.astype(np.float32) > 0, np.float32(1) / dec, 0).astype(np.float32)
        sf_bytes = sf.view(np.uint8)
    else:
        finfo = np.float32(448 if mma == "fp8xfp4" else 6)
        exp = _ue8m0_oracle((np.maximum(gmax, np.float32(1e-4)) / finfo).astype(np.float32))
        inv = np.ldexp(np.float32(1), 127 - exp).astype(np.float32)
        sf_bytes = exp.astype(np.uint8)
    scaled = (g * inv[..., None]).astype(np.float32).reshape(t, h)
    if mma == "fp8xfp4":
        q = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    else:
        c = _e2m1_oracle(scaled).reshape(t, h // 2, 2)
        q = (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)
    return q, sf_bytes, None if pts is None else pts.reshape(t)


def sm100_data(t: int, h: int):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(t, h, generator=g) * torch.logspace(-3, 2, t)[:, None]).bfloat16()
    x[0, :64] = 0  # zero groups: the 1e-4 floor, and an NVFP4 scale of 0
    x[2] = (torch.randn(h, generator=g) * 1e-5).bfloat16()  # a row under the 1e-4 floor
    # E2M1 midpoints at scale 1 (amax 6 -> raw 1 -> inv 1 in UE8M0 mode): ties to even.
    x[1, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5] + [0.0] * 22)
    return x


@pytest.mark.parametrize(("mma", "gs"), [("fp8xfp4", 32), ("fp8xfp4", 128), ("mxf4xmxf4", 32),
                                         ("nvfp4xnvfp4", 16)],
                         ids=["fp8-32", "fp8-128", "mxfp4-32", "nvfp4-16"])
def test_sm100_pre_dispatch_matches_the_oracle(mma, gs):
    t, tmax, h, k = 6, 8, 512, 3
    x = sm100_data(t, h)
    ids = torch.tensor([[0, 4, -1]] * t, dtype=torch.int32)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(3))
    escale = torch.tensor([0.5, 1.0, 3.0, 0.1, 2.0])
    bytes_per_row = h if mma == "fp8xfp4" else h // 2
    buf_x = torch.zeros(tmax, bytes_per_row, dtype=torch.uint8)
    if mma == "fp8xfp4":
        buf_x = buf_x.view(torch.float8_e4m3fn)
    buf_sf = torch.full((tmax, h // gs // 4), -1, dtype=torch.int32)
    bidx, bw = torch.full((tmax, k), 9, dtype=torch.int64), torch.full((tmax, k), 9.0)
    scales = torch.full((tmax,), -1.0)
    from moewire.reference.sgl_staging import mega_moe_pre_dispatch

    mega_moe_pre_dispatch(x, ids, w, buf_x, buf_sf, bidx, bw, t, gs, mma,
                          buf_x_scales=scales if mma == "nvfp4xnvfp4" else None,
                          expert_scales=escale)
    q, sf_bytes, pts = sm100_oracle(x.float().numpy(), mma, gs)
    np.testing.assert_array_equal(buf_x.view(torch.uint8)[:t].numpy(), q)
    np.testing.assert_array_equal(buf_sf.view(torch.uint8).view(tmax, -1)[:t].numpy(), sf_bytes)
    if pts is not None:
        np.testing.assert_array_equal(scales[:t].numpy(), pts)
        assert (scales[t:] == -1).all()
    want_w = w.numpy().copy()
    want_w[:, 0] *= np.float32(0.5)
    want_w[:, 1] *= np.float32(2.0)
    np.testing.assert_array_equal(bw[:t].numpy(), want_w)
    assert (bidx[t:] == -1).all() and (bw[t:] == 0).all()
    assert torch.equal(bidx[:t], ids.long())


@pytest.mark.parametrize(
    ("mma", "gs", "match"),
    [("fp8xfp8", 32, "unknown mma_type"), ("nvfp4xnvfp4", 32, "group_size 32 is not"),
     ("mxf4xmxf4", 16, "group_size 16 is not"), ("nvfp4xnvfp4", 16, "pass buf_x_scales")],
    ids=["unknown-mma", "nvfp4-group-32", "mxfp4-group-16", "nvfp4-no-x-scales"],
)
def test_sm100_pre_dispatch_refuses(mma, gs, match):
    from moewire.reference.sgl_staging import mega_moe_pre_dispatch

    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        mega_moe_pre_dispatch(x, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 1),
                              torch.zeros(4, 512, dtype=torch.uint8),
                              torch.zeros(4, 4, dtype=torch.int32),
                              torch.zeros(4, 1, dtype=torch.int64), torch.zeros(4, 1), 2, gs, mma)


# -- SGLang's own fp8xfp4 cast --------------------------------------------------------------------


@pytest.mark.parametrize("gs", [32, 128], ids=["group-32", "group-128"])
def test_sglang_cast_matches_the_oracle(gs):
    from moewire.reference.sgl_staging import sglang_mega_moe_pre_dispatch

    t, tmax, h, k = 6, 8, 512, 2
    x = sm100_data(t, h)
    x[3, :gs] = 0  # a zero group: the 1e-10 floor (sgl-deep-gemm's SM100 cast uses 1e-4)
    ids = torch.tensor([[1, -1]] * t, dtype=torch.int32)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(5))
    buf_x = torch.zeros(tmax, h, dtype=torch.float8_e4m3fn)
    # Rows padded to 8 int32 (32 bytes): the scale bytes follow the row stride.
    sf_store = torch.full((tmax, 8), -1, dtype=torch.int32)
    buf_sf = sf_store[:, : h // gs // 4]
    bidx, bw = torch.full((tmax, k), 9, dtype=torch.int64), torch.full((tmax, k), 9.0)
    sglang_mega_moe_pre_dispatch(x, ids, w, buf_x, buf_sf, bidx, bw, gs)
    g = x.float().numpy().reshape(t, h // gs, gs)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-10)).astype(np.float32)
    m, e = np.frexp((amax / np.float32(448)).astype(np.float32).astype(np.float64))
    exp = np.where(m == 0.5, e - 1, e) + 127
    inv = np.ldexp(np.float32(1), 127 - exp).astype(np.float32)
    q = np.clip((g * inv[..., None]).astype(np.float32), -448, 448).astype(
        ml_dtypes.float8_e4m3fn).reshape(t, h)
    np.testing.assert_array_equal(buf_x[:t].view(torch.uint8).numpy(), q.view(np.uint8))
    sf_bytes = sf_store.view(torch.uint8).numpy()
    np.testing.assert_array_equal(sf_bytes[:t, : h // gs], exp.astype(np.uint8))
    assert (sf_bytes[:t, h // gs :] == 0xFF).all() and (sf_bytes[t:] == 0xFF).all()
    assert torch.equal(bidx[:t], ids.long()) and torch.equal(bw[:t], w)
    assert (bidx[t:] == -1).all() and (bw[t:] == 0).all()
    sglang_mega_moe_pre_dispatch(x, ids, w * 0, buf_x, buf_sf, bidx, bw, gs, copy_topk=False)
    assert torch.equal(bw[:t], w)  # Mega-Gate's routing stays


@pytest.mark.parametrize(("change", "match"), [({"quant_group_size": 16}, "must be 32, 64"),
                                               ({"shared_x_sf": "yes"}, "not modelled")],
                         ids=["group-16", "shared-x-sf"])
def test_sglang_cast_refuses(change, match):
    from moewire.reference.sgl_staging import sglang_mega_moe_pre_dispatch

    if "shared_x_sf" in change:
        change = {"shared_x_sf": torch.zeros(1, dtype=torch.int32)}
    with pytest.raises(ValueError, match=match):
        sglang_mega_moe_pre_dispatch(
            torch.zeros(2, 512, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int32),
            torch.zeros(2, 1), torch.zeros(4, 512, dtype=torch.float8_e4m3fn),
            torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int64),
            torch.zeros(4, 1), **change)
