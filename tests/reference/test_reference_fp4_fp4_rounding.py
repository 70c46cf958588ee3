"""Two rounding points of the stand-in NVFP4 x NVFP4 kernel (DeepGEMM 2.8.0
``fp4_fp4_mega_moe``, ``impls/sm100_fp4_fp4_mega_moe.cuh`` at 794783a) that random data almost
never shows, on data crafted to show them:

- the L2 input's requantization factor is one division ``fl(inv / sf)``, not
  ``fl(inv * fl(1 / sf))``;
- the L2 scale is one product ``fl(l2_alpha * a2_scale)`` applied once, not
  ``fl(fl(acc * l2_alpha) * a2_scale)`` (about 26 in 2 million accumulators differ).

Each test first shows that its data tells the two versions apart, then that the stand-in
gives the kernel's.
"""

from __future__ import annotations

import numpy as np
import torch
from fp4_fp4_cases import SMALL, buffer, cached_weights
from fp4_fp4_oracle import F32, e2m1_codes, e4m3
from reference_cases import tokens

from moewire.reference import deep_gemm
from moewire.reference.fp4_fp4 import mega_moe
from moewire.reference.fp4_fp4._numerics import requantize_l2_input

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # E2M1's rounding boundaries


def _ulps_around(v: np.float32, n: int) -> list[np.float32]:
    """``v`` and its ``n`` float32 neighbours on each side."""
    below, above = [v], [v]
    for _ in range(n):
        below.append(np.nextafter(below[-1], F32(0), dtype=F32))
        above.append(np.nextafter(above[-1], F32(np.inf), dtype=F32))
    return below[:0:-1] + above


def _factor_cases(amax: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """``(a2, v)`` float32 pairs where a block ``[amax, v, 0, ...]`` requantized with
    ``inv = fl(1 / a2)`` gives ``v`` another E2M1 code with ``fl(inv / sf)`` than with
    ``fl(inv * fl(1 / sf))``.

    Search: for 4096 a2 in [0.3, 1.7], the block scale ``sf`` (numpy float32 and ml_dtypes,
    as the kernel); where the two factors differ by an ulp, ``v`` near ``midpoint / factor``
    for each E2M1 midpoint, stepping by ulps, puts ``v * factor`` on the midpoint with one
    factor and off it with the other, so the code differs.
    """
    a2 = np.linspace(0.3, 1.7, 4096, dtype=F32)
    inv = (F32(1.0) / a2).astype(F32)
    scaled = (F32(amax) * F32(1.0 / 6.0)).astype(F32)
    sf = e4m3(np.maximum((scaled * inv).astype(F32), F32(2.0**-9)))
    one = (inv / sf).astype(F32)
    two = (inv * (F32(1.0) / sf).astype(F32)).astype(F32)
    found_a2, found_v = [], []
    for i in np.flatnonzero(one != two):
        for m in MIDPOINTS:
            for v in _ulps_around((F32(m) / one[i]).astype(F32), 3):
                if (e2m1_codes(np.array([v * one[i]], F32))
                        != e2m1_codes(np.array([v * two[i]], F32)))[0]:
                    found_a2.append(a2[i])
                    found_v.append(v)
    return np.array(found_a2, F32), np.array(found_v, F32)


def test_the_requantization_factor_is_one_division():
    """``code = e2m1(fl(h * fl(inv / sf)))``: on crafted blocks where one extra rounding of
    the factor moves a value across an E2M1 midpoint, the stand-in's codes are the
    one-division codes. Break: ``inv * (1 / sf)``."""
    a2, v = _factor_cases()
    assert len(a2) >= 8, "the search finds too few blocks that tell the two factors apart"
    amax = F32(5.0)
    h = np.zeros((len(a2), 16), F32)
    h[:, 0], h[:, 1] = amax, v
    inv = (F32(1.0) / a2).astype(F32)
    sf = e4m3(np.maximum(((amax * F32(1.0 / 6.0)).astype(F32) * inv).astype(F32),
                         F32(2.0**-9)))
    one = e2m1_codes((h * (inv / sf)[:, None].astype(F32)).astype(F32))
    two = e2m1_codes((h * (inv * (F32(1.0) / sf).astype(F32))[:, None]).astype(F32))
    assert (one[:, 1] != two[:, 1]).all()  # the data tells the two versions apart
    codes, got_sf = requantize_l2_input(torch.from_numpy(h), torch.from_numpy(a2))
    assert np.array_equal(got_sf[:, 0].numpy(), sf)
    assert np.array_equal(codes.numpy(), one)


def _run_capturing_acc2(monkeypatch, buf, weights, x, ids, w, l2_alphas, a2_scales):
    """Run the stand-in; return ``(combine rows [k, T, H] FP32, the L2 accumulator FP32
    [T, H])``: here one routed row per token, so the pool order is the token order. The
    accumulator is recorded from the stand-in's own grouped matmul (its second call, the L2
    GEMM), which runs unchanged."""
    from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

    seen = []
    real = mega_moe._kernel._grouped_matmul

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out.clone())
        return out

    monkeypatch.setattr(mega_moe._kernel, "_grouped_matmul", recording)
    t = x.shape[0]
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])
    y = torch.empty((t, buf.hidden), dtype=torch.bfloat16)
    deep_gemm.fp4_fp4_mega_moe(y, weights.l1, weights.l2, buf, l1_alphas=weights.l1_alphas,
                               l2_alphas=l2_alphas, a2_scales=a2_scales)
    monkeypatch.setattr(mega_moe._kernel, "_grouped_matmul", real)
    assert len(seen) == 2
    # Rows past the routed ones (the invalid slots, sorted last) are left undefined.
    return buf.combine_rows()[:, :t].float(), seen[1][:t]


def _one_and_two_roundings(acc: torch.Tensor, alpha: torch.Tensor, a2: torch.Tensor):
    """BF16-rounded rows (router weight 1) with the L2 scale as one product and as two."""
    one = (acc * (alpha * a2)).bfloat16().float()
    two = ((acc * alpha) * a2).bfloat16().float()
    return one, two


def test_the_l2_scale_is_one_product(monkeypatch):
    """``bf16(fl(acc * fl(l2_alpha * a2_scale)))``: every token routed to expert 0 in slot 0
    with weight 1, so the pool order is the token order and the combine row is the rounded
    scaled accumulator. The L2 accumulator does not depend on ``l2_alpha``, so the test reads
    it from a first run and searches ``l2_alpha`` (ulp steps from 1.37, ``a2_scale`` 0.61) for
    one where the two roundings give another BF16 row element; the second run, with that
    ``l2_alpha``, must give the one-product rows. Break: scale by ``l2_alpha`` then by
    ``a2_scale``."""
    t, e = 32, SMALL["num_experts"]
    buf = buffer(tmax=t)
    weights = cached_weights(e, SMALL["hidden"], SMALL["intermediate"], num_shared_experts=0,
                             seed=5, device="cpu")
    x = tokens(t, SMALL["hidden"], seed=41)
    ids = torch.full((t, SMALL["num_topk"]), -1, dtype=torch.long)
    ids[:, 0] = 0
    w = torch.zeros((t, SMALL["num_topk"]), dtype=torch.float32)
    w[:, 0] = 1.0
    a2 = torch.full((e,), 0.61, dtype=torch.float32)
    alpha0 = weights.l2_alphas.clone()
    _, acc = _run_capturing_acc2(monkeypatch, buf, weights, x, ids, w, alpha0, a2)
    chosen = None
    for step in range(1, 4096):
        alpha = torch.tensor(1.37 * (1 + step * 2.0**-22), dtype=torch.float32)
        one, two = _one_and_two_roundings(acc, alpha, a2[0])
        if not torch.equal(one, two):
            chosen = alpha
            break
    assert chosen is not None, "no l2_alpha found that tells the two roundings apart"
    rows, acc_again = _run_capturing_acc2(monkeypatch, buf, weights, x, ids, w,
                                          torch.full((e,), float(chosen)), a2)
    assert torch.equal(acc_again, acc)
    one, two = _one_and_two_roundings(acc, chosen, a2[0])
    assert not torch.equal(one, two)  # the data tells the two versions apart
    assert torch.equal(rows[0], one)
