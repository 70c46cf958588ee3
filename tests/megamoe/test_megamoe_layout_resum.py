"""flavours, combine_rows and resum against a hand-made buffer and a NumPy oracle."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from moewire.megamoe import flavours
from moewire.megamoe.layout import combine_rows
from moewire.megamoe.resum import resum

TMAX, K, H = 16, 4, 64


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> BF16 (round to nearest even, ml_dtypes) as uint16 bits."""
    return a.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def torch_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def make_buffer(flavour: str, fused_shared: bool, seed: int, tail: int = 96):
    """A flat int8 buffer laid out by hand: junk, l2_acts, l2_acts_sf, [combine], [tail].

    Returns the SymmBuffer-like namespace and the combine rows as float32 NumPy
    ``[num_slots, TMAX, H]`` (BF16 values), written at the byte offset the flavour's rule
    must find, computed here independently.
    """
    g = np.random.default_rng(seed)
    slots = K + int(fused_shared)
    junk, l2_bytes, sf_bytes = 40, 8 * 32, 8 * 4 * 4
    comb_bytes = slots * TMAX * H * 2
    after = tail if flavour == "sgl" else 0
    total = junk + l2_bytes + sf_bytes + comb_bytes + after
    raw = g.integers(-128, 128, size=total, dtype=np.int8)
    values = g.standard_normal((slots, TMAX, H)).astype(np.float32)
    bits = bf16_bits(values)
    base = junk + l2_bytes + sf_bytes
    raw[base : base + comb_bytes] = bits.reshape(-1).view(np.int8)
    flat = torch.from_numpy(raw.copy())
    l2_acts = flat[junk : junk + l2_bytes].view(torch.float8_e4m3fn).view(8, 32)
    l2_acts_sf = flat[junk + l2_bytes : base].view(torch.int32).view(8, 4)
    buf = SimpleNamespace(
        buffer=flat,
        num_max_tokens_per_rank=TMAX,
        num_topk=K,
        hidden=H,
        l2_acts=l2_acts,
        l2_acts_sf=l2_acts_sf,
    )
    return buf, bits.view(ml_dtypes.bfloat16).astype(np.float32), base


@pytest.mark.parametrize(
    "flavour,fused",
    [("upstream", False), ("vllm", False), ("vllm", True), ("sgl", False), ("sgl", True)],
)
def test_combine_rows_is_the_region_as_a_view(flavour, fused):
    buf, expected, base = make_buffer(flavour, fused, seed=1)
    rows = combine_rows(buf, flavour, fused_shared=fused)
    assert rows.dtype == torch.bfloat16 and rows.shape == (K + fused, TMAX, H)
    np.testing.assert_array_equal(rows.float().numpy(), expected)
    assert rows.data_ptr() == buf.buffer.data_ptr() + base
    buf.buffer[base : base + 2] = torch.tensor([0, 0x7F], dtype=torch.int8)
    assert torch_bits(rows[0, 0, :1])[0] == 0x7F00  # same storage: no copy


def test_flavours_agree_on_an_upstream_layout():
    buf, _, _ = make_buffer("upstream", False, seed=2)
    a = combine_rows(buf, "upstream")
    b = combine_rows(buf, "sgl")
    assert a.data_ptr() == b.data_ptr()


def test_flavour_registry():
    assert flavours.names() == ["sgl", "upstream", "vllm"]
    assert flavours.get("vllm").shared_slot == "last"
    assert flavours.get("sgl").shared_slot == "first"
    assert flavours.get("sgl").combine_base_rule == "after_l2_acts_sf"
    assert flavours.get("upstream").shared_slot is None
    f = flavours.get("upstream")
    assert flavours.get(f) is f


def _bad_fields(buf):
    buf.num_topk = 0
    return buf


def _small(buf):
    buf.buffer = buf.buffer[:100]
    return buf


def _no_sf(buf):
    del buf.l2_acts_sf, buf.l2_acts
    return buf


def _not_int8(buf):
    buf.buffer = buf.buffer.view(torch.int16)
    return buf


def _foreign_view(buf):
    buf.l2_acts_sf = buf.l2_acts_sf.clone()
    return buf


@pytest.mark.parametrize(
    "flavour,fused,damage,match",
    [
        ("vllm", False, _small, "does not fit"),
        ("sgl", False, _no_sf, "l2_acts_sf"),
        ("upstream", True, None, "no fused shared expert slot"),
        ("vllm", False, _not_int8, "flat int8"),
        ("vllm", False, _bad_fields, "num_topk"),
        ("sgl", False, _foreign_view, "does not share storage"),
        ("nope", False, None, "unknown kernel flavour 'nope'"),
    ],
    ids=[
        "too-small",
        "sgl-no-l2-view",
        "upstream-shared",
        "not-int8",
        "bad-field",
        "foreign-view",
        "unknown-flavour",
    ],
)
def test_combine_rows_refusals(flavour, fused, damage, match):
    buf, _, _ = make_buffer("vllm" if flavour == "nope" else flavour, False, seed=3)
    if damage is not None:
        buf = damage(buf)
    with pytest.raises(ValueError, match=match):
        combine_rows(buf, flavour, fused_shared=fused)


@pytest.mark.parametrize(
    "rule,shared,match",
    [("no_such_rule", None, "unknown combine base rule"), ("last_region", "middle", "shared_slot")],
    ids=["bad-rule", "bad-shared-slot"],
)
def test_flavour_refusals(rule, shared, match):
    with pytest.raises(ValueError, match=match):
        flavours.Flavour("x", rule, shared)


def test_register_refusals():
    with pytest.raises(ValueError, match="already registered"):
        flavours.register(flavours.Flavour("vllm", "last_region", "last"))
    with pytest.raises(TypeError, match="expected a Flavour"):
        flavours.register("vllm")
    with pytest.raises(ValueError, match="already registered"):
        flavours.register_base_rule("last_region", lambda b, n, f: 0)


# -- resum --------------------------------------------------------------------------------


def oracle_resum(rows, topk_idx, t, shared_slot, quant=None):
    """Per token, a Python loop over the valid slots in ascending order, FP32 accumulate
    with NumPy float32 scalars, shared row unquantized, one BF16 rounding (ml_dtypes)."""
    slots, _, h = rows.shape
    k = topk_idx.shape[1]
    routed = rows[1:] if shared_slot == "first" else rows[:k]
    out = np.zeros((t, h), dtype=np.uint16)
    for tok in range(t):
        acc = np.zeros(h, dtype=np.float32)
        terms = []
        if shared_slot == "first":
            terms.append(rows[0, tok])
        for s in range(k):
            if topk_idx[tok, s] >= 0:
                r = routed[s, tok]
                terms.append(quant(r) if quant is not None else r)
        if shared_slot == "last":
            terms.append(rows[k, tok])
        for term in terms:
            acc = (acc + term.astype(np.float32)).astype(np.float32)
        out[tok] = bf16_bits(acc)
    return out


def random_case(seed, shared_slot, t=11):
    g = torch.Generator().manual_seed(seed)
    slots = K + (shared_slot is not None)
    rows = (torch.randn(slots, TMAX, H, generator=g) * 3).bfloat16()
    topk_idx = torch.randint(0, 32, (TMAX, K), generator=g)
    topk_idx[torch.rand(TMAX, K, generator=g) < 0.35] = -1
    topk_idx[0] = -1  # a token with no valid slot
    topk_idx[t:] = -1
    routed = rows[1:] if shared_slot == "first" else rows[:K]
    stale = topk_idx[:, :].T < 0  # [K, TMAX]: invalid slots hold stale data, here NaN
    routed[stale] = float("nan")
    return rows, topk_idx


def e4m3_torch(r: torch.Tensor) -> torch.Tensor:
    return r.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.bfloat16)


def e4m3_numpy(r: np.ndarray) -> np.ndarray:
    c = np.clip(r.astype(np.float32), -448, 448)
    return c.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


@pytest.mark.parametrize("shared_slot", [None, "first", "last"], ids=["no-shared", "first", "last"])
@pytest.mark.parametrize("quant", [False, True], ids=["plain", "e4m3-rows"])
def test_resum_matches_oracle(shared_slot, quant):
    rows, topk_idx = random_case(seed=7, shared_slot=shared_slot)
    t = 11
    y = torch.full((t, H), 5.0, dtype=torch.bfloat16)
    address = y.data_ptr()
    got = resum(rows, topk_idx, t, shared_slot, e4m3_torch if quant else None, out=y)
    assert got is y and y.data_ptr() == address
    want = oracle_resum(
        rows.float().numpy(), topk_idx.numpy(), t, shared_slot, e4m3_numpy if quant else None
    )
    np.testing.assert_array_equal(torch_bits(y), want)
    assert not torch.isnan(y).any()  # stale NaN rows never leak
    if shared_slot is None:
        assert (torch_bits(y[0]) == 0).all()  # no valid slot: +0, not -0


def test_resum_shared_slot_is_never_quantized():
    rows, topk_idx = random_case(seed=8, shared_slot="last")
    topk_idx[:] = -1
    seen = []
    y = resum(rows, topk_idx, 5, "last", lambda r: seen.append(r.shape) or r * 0)
    np.testing.assert_array_equal(torch_bits(y), bf16_bits(rows[K, :5].float().numpy()))
    assert seen == [(K, 5, H)]


def test_resum_order_is_ascending_fp32_with_one_rounding():
    # 2^24, 2^16, 1, 1: ascending in FP32 the two 1s vanish (ties to even at ulp 2) and the
    # BF16 tie rounds to 2^24; descending (or a float64 sum) keeps them and rounds up.
    rows = torch.zeros(K, TMAX, H, dtype=torch.bfloat16)
    for s, v in enumerate([2.0**24, 2.0**16, 1.0, 1.0]):
        rows[s, 0, 0] = v
    topk_idx = torch.zeros(TMAX, K, dtype=torch.int64)
    assert resum(rows, topk_idx, 1)[0, 0].item() == 2.0**24
    assert resum(rows.flip(0), topk_idx, 1)[0, 0].item() == 2.0**24 + 2.0**17


def test_resum_allocates_when_no_out():
    rows, topk_idx = random_case(seed=9, shared_slot=None)
    y = resum(rows, topk_idx, 3)
    assert y.shape == (3, H) and y.dtype == torch.bfloat16
    np.testing.assert_array_equal(
        torch_bits(y), oracle_resum(rows.float().numpy(), topk_idx.numpy(), 3, None)
    )


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"rows": torch.zeros(K, TMAX, H)}, ValueError, "rows must be a BF16"),
        ({"topk_idx": torch.zeros(TMAX, K)}, ValueError, "topk_idx must be an integer"),
        ({"shared_slot": "middle"}, ValueError, "shared_slot must be"),
        ({"shared_slot": "last"}, ValueError, "rows has 4 slots"),
        ({"num_tokens": TMAX + 1}, ValueError, "num_tokens=17 must lie"),
        ({"num_tokens": 2.0}, TypeError, "num_tokens must be an int"),
        ({"out": torch.zeros(3, H)}, ValueError, "out must be BF16"),
        ({"out": torch.zeros(4, H, dtype=torch.bfloat16)}, ValueError, "out must be BF16"),
    ],
    ids=[
        "rows-fp32",
        "idx-float",
        "bad-shared",
        "slot-count",
        "too-many-tokens",
        "tokens-float",
        "out-fp32",
        "out-shape",
    ],
)
def test_resum_refusals(kwargs, exc, match):
    args = {
        "rows": torch.zeros(K, TMAX, H, dtype=torch.bfloat16),
        "topk_idx": torch.zeros(TMAX, K, dtype=torch.int64),
        "num_tokens": 3,
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        resum(**args)
