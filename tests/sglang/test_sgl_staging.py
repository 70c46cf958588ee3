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
