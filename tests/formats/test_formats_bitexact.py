"""Every format against its independent oracle, bit for bit, on fresh random data."""

from __future__ import annotations

import fmt_data
import fmt_oracle
import numpy as np
import pytest
import torch

from moewire import formats

NAMES = sorted(fmt_oracle.ORACLES)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16in", "fp16in", "fp32in"]
SHAPES = [(4, 2048), (2, 3, 1536), (384,)]


def test_every_registered_format_has_an_oracle():
    assert formats.names() == NAMES


def _amax(fmt, x, seed):
    return fmt_data.amax_of(x, seed) if fmt.needs_amax else None


# ``bf16`` on BF16 input is the identity: those cases would prove a copy, so they are
# left out here and the identity is asserted once, on every kind, by the test below.
NAME_DTYPES = [
    pytest.param(name, dtype, id=f"{name}-{dtype_id}")
    for name in NAMES
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS, strict=True)
    if not (name == "bf16" and dtype == torch.bfloat16)
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", fmt_data.KINDS)
@pytest.mark.parametrize("name,dtype", NAME_DTYPES)
def test_matches_oracle(name, kind, dtype, shape):
    seed = fmt_data.seed_of(name, kind, dtype, shape)
    x = fmt_data.make(kind, shape, dtype, seed)
    fmt = formats.get(name)
    amax = _amax(fmt, x, seed)
    x_before = x.clone()
    out = fmt.qdq(x, amax)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(x.view(torch.uint8), x_before.view(torch.uint8)), "input was modified"
    want = fmt_oracle.expected(name, x, amax)
    fmt_oracle.assert_bits_equal(out, want, f"{name}/{kind}/{dtype}/{shape}", seed=seed)


def test_bf16_on_bf16_input_is_a_bit_copy():
    """The one claim the ``bf16`` format makes on BF16 data: every bit (NaN payloads,
    -0.0, subnormals) comes back unchanged, in a new tensor."""
    for kind in fmt_data.KINDS:
        seed = fmt_data.seed_of("bf16-identity", kind)
        x = fmt_data.make(kind, (4, 2048), torch.bfloat16, seed)
        out = formats.get("bf16").qdq(x)
        assert out.data_ptr() != x.data_ptr(), kind
        assert torch.equal(out.view(torch.int16), x.view(torch.int16)), f"{kind} (seed {seed})"


@pytest.mark.parametrize("name", NAMES)
def test_quantizes_for_real(name):
    """Guards against an oracle and a reference that agree by both doing nothing."""
    x = fmt_data.make("normal", (8, 1024), torch.float32, fmt_data.seed_of("real", name)) * 1e-3
    fmt = formats.get(name)
    out = fmt.qdq(x, x.abs().amax() if fmt.needs_amax else None)
    err = ((out - x).norm() / x.norm()).item()
    # MoRI's combines scale no block below the FP8 maximum: rows of 1e-3 x 2^-12 fall
    # under FP8's smallest subnormal and come back as zeros (relative error 1 there).
    bound = {"bf16": 4e-3, "logfmt10": 1e-2}.get(name, 1.0 if name.startswith("mori") else 0.2)
    assert 0 < err < bound, err


# -- the details each format's source insists on ------------------------------------------


def test_fp8_scale_is_448_times_the_rounded_reciprocal():
    """ModelOpt's `448.0 / safe` is 448 * fl(1/safe): find amaxes where that differs from a
    true division and data where the difference shows, and check the reference follows it."""
    rng = np.random.default_rng(7)
    amaxes = rng.uniform(0.5, 4.0, 4000).astype(np.float32)
    two = np.float32(448) * (np.float32(1) / amaxes)
    one = np.float32(448) / amaxes
    amax = float(amaxes[two != one][0])
    s_two, s_one = (
        np.float32(448) * (np.float32(1) / np.float32(amax)),
        np.float32(448) / np.float32(amax),
    )
    # Values whose scaled image sits within an ulp of an E4M3 midpoint split the two scales.
    mids = np.array(fmt_data._E4M3_MIDS, dtype=np.float64)
    mids = mids[mids < 448]
    cand = np.concatenate([mids / s_two, np.nextafter((mids / s_two).astype(np.float32), 0)])
    x = torch.from_numpy(cand.astype(np.float32))
    want_two = fmt_oracle.e4m3((x.numpy() * s_two).astype(np.float32))
    want_one = fmt_oracle.e4m3((x.numpy() * s_one).astype(np.float32))
    assert (want_two != want_one).any(), "test data does not separate the two scales"
    out = formats.get("fp8").qdq(x, amax)
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("fp8", x, amax), "fp8 two roundings")


@pytest.mark.parametrize(
    "amax", [0.0, 2.0**-24, 2.0**-30], ids=["zero", "exactly-2^-24", "below-2^-24"]
)
def test_fp8_tiny_amax_falls_back_to_one(amax):
    x = fmt_data.make("normal", (2, 64), torch.float32, 3) * 0.01
    fmt = formats.get("fp8")
    assert torch.equal(fmt.qdq(x, amax), fmt.qdq(x, 1.0))


def test_nvfp4_zero_amax_uses_global_scale_1e_12():
    """gs = 1e-12 makes every block scale <= 448e-12 < 1e-5, so ModelOpt's `bs = 1` rule
    applies: the block is rounded straight onto the E2M1 grid."""
    x = torch.from_numpy(np.random.default_rng(4).normal(0, 2, (2, 64)).astype(np.float32))
    out = formats.get("nvfp4").qdq(x, 0.0)
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("nvfp4", x, 0.0), "nvfp4 amax=0")
    plain = torch.from_numpy(fmt_oracle.e2m1(x.numpy()).astype(np.float32))
    assert torch.equal(out, torch.where(out == 0, out, plain)) and out.abs().sum() > 0


def test_nvfp4_global_amax_2688_makes_block_scales_plain_e4m3():
    x = torch.tensor([[6.0, 3.0, 1.25, -0.75] + [0.0] * 12], dtype=torch.float32)
    out = formats.get("nvfp4").qdq(x, 2688.0)
    assert out[0, :4].tolist() == [6.0, 3.0, 1.0, -1.0]


def test_mx_scale_uses_floor_and_saturates():
    """OCP: 2^(floor(log2 amax) - emax); a block max of 500 gets scale 2^0 and saturates
    to 448 (DeepGEMM's ceil rule would pick 2^1 and keep 500 as 512)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 500.0, 1.0
    out = formats.get("mxfp8").qdq(x)
    assert out[0, 0] == 448.0 and out[0, 1] == 1.0
    staged = formats.get("fp8_b32_ue8m0").qdq(x)
    assert staged[0, 0] == 512.0


def test_mxfp4_rounds_ties_to_even():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x = torch.tensor([mids * 4], dtype=torch.float32)
    out = formats.get("mxfp4").qdq(x)  # amax 6 -> scale 2^(2-2) = 1
    assert out[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_ue8m0_scale_is_an_exact_ceil_not_a_rounded_log2():
    """amax/448 just above 2^10 must give the scale 2^11. torch.log2 of that FP32 value
    rounds to exactly 10.0 and would give 2^10, which shows on a small element: 3.0 is
    0.75 * 2^-9 under 2^11 (-> 2^-9, decodes to 4) but a tie 1.5 * 2^-9 under 2^10 (-> 2,
    decodes to 2)."""
    amax = np.nextafter(np.float32(448 * 1024), np.float32(np.inf))
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = float(amax), 3.0
    out = formats.get("fp8_b32_ue8m0").qdq(x)
    assert out[0, 1] == 4.0
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("fp8_b32_ue8m0", x), "ceil")


def test_logfmt10_blocks_at_or_above_one_stay_bf16():
    rng = np.random.default_rng(11)
    v = rng.uniform(-0.9, 0.9, (2, 2048)).astype(np.float32)
    v[0, 5] = 1.0  # group 0 of row 0 (channels 0..1023) must stay BF16
    x = torch.from_numpy(v)
    out = formats.get("logfmt10").qdq(x)
    bf = x.to(torch.bfloat16).float()
    assert torch.equal(out[0, :1024], bf[0, :1024])
    assert not torch.equal(out[0, 1024:], bf[0, 1024:])
    assert not torch.equal(out[1], bf[1])
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("logfmt10", x), "logfmt10")


@pytest.mark.parametrize("hidden,group", [(2048, 1024), (1536, 512), (384, 512)])
def test_logfmt10_cast_group_follows_deepep_send_unrolls(hidden, group):
    from moewire.formats.logfmt import cast_group

    assert cast_group(hidden) == group
    rng = np.random.default_rng(hidden)
    x = torch.from_numpy(rng.uniform(0.01, 0.4, (1, hidden)).astype(np.float32))
    x[0, hidden - 1] = 2.0  # poisons exactly the last cast group
    out = formats.get("logfmt10").qdq(x)
    bf = x.to(torch.bfloat16).float()
    last = (hidden - 1) // group * group
    assert torch.equal(out[0, last:], bf[0, last:])
    for g0 in range(0, last, group):
        assert not torch.equal(out[0, g0 : g0 + group], bf[0, g0 : g0 + group])
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("logfmt10", x), "logfmt10 groups")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_logfmt10_nan_in_a_cast_block_becomes_a_signed_zero(dtype):
    x = torch.linspace(0.01, 0.5, 1024).reshape(1, 1024)
    x[0, 7], x[0, 9] = float("nan"), -float("nan")
    x = x.to(dtype)
    out = formats.get("logfmt10").qdq(x)
    assert out[0, 7] == 0 and out[0, 9] == 0 and torch.isfinite(out).all()
    assert torch.signbit(out[0, 7]) == torch.signbit(x[0, 7])
    assert torch.signbit(out[0, 9]) == torch.signbit(x[0, 9])
    fmt_oracle.assert_bits_equal(out, fmt_oracle.expected("logfmt10", x), "logfmt10 NaN")


@pytest.mark.parametrize("name", NAMES)
def test_zero_blocks_stay_zero(name):
    x = torch.zeros(2, 1024)
    x[1, :512] = -0.0
    fmt = formats.get(name)
    out = fmt.qdq(x, 1.0 if fmt.needs_amax else None)
    assert torch.equal(out, torch.zeros_like(out)) and not torch.isnan(out).any()


# -- a division by a constant is torch's CUDA rule, t * fl(1/c), on every device ----------

F32 = np.float32


def _split_amaxes(c: float, n: int, seed: int) -> np.ndarray:
    """``n`` FP32 amaxes in [0.5, 4) where a true division by ``c`` differs from the
    multiplication by the FP32 reciprocal (torch's CPU vs its CUDA ``a / c``)."""
    a = np.random.default_rng(seed).uniform(0.5, 4.0, 20 * n).astype(F32)
    split = a[(a / F32(c)) != (a * (F32(1) / F32(c)))]
    assert split.size >= n, "too few amaxes split the two divisions"
    return split[:n]


def _rows_with_max(amaxes: np.ndarray, hidden: int, seed: int) -> np.ndarray:
    """FP32 ``[len(amaxes), hidden]``: row r has max|x| exactly ``amaxes[r]``."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1.0, 1.0, (amaxes.size, hidden)) * amaxes[:, None]).astype(F32)
    x[:, 3] = -amaxes
    return x


def _true_division_fp8_b128(x: np.ndarray) -> np.ndarray:
    a = np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), F32(1e-4))
    sf = a / F32(448.0)
    return fmt_oracle.e4m3(x * (F32(1) / sf)).astype(F32) * sf


def _true_division(name: str, x: np.ndarray, amax) -> np.ndarray:
    """What the reference gave before it wrote out the reciprocal (a true division)."""
    if name == "fp8_b128":
        return _true_division_fp8_b128(x)
    if name == "nvfp4":
        return fmt_oracle._nvfp4(x, np.asarray(F32(amax) / F32(2688.0), dtype=F32))
    row = np.max(np.abs(x), axis=-1, keepdims=True)[..., None]
    return fmt_oracle._nvfp4(x, (row / F32(2688.0)).astype(F32))


@pytest.mark.parametrize(
    "name,divisor", [("fp8_b128", 448.0), ("nvfp4", 2688.0), ("nvfp4_token", 2688.0)]
)
def test_constant_division_is_the_cuda_reciprocal_form(name, divisor):
    """On amaxes where ``a / c`` and ``a * fl(1/c)`` disagree, the CPU reference follows
    the reciprocal (what torch computes on CUDA), bit for bit, and not the true division."""
    amaxes = _split_amaxes(divisor, 8, seed=fmt_data.seed_of("split", name))
    xs = _rows_with_max(amaxes, 128, seed=5)
    fmt = formats.get(name)
    differs = 0
    for row, a in zip(xs, amaxes, strict=True):
        x = torch.from_numpy(row[None].copy())
        amax = float(a) if fmt.needs_amax else None
        out = fmt.qdq(x, amax)
        fmt_oracle.assert_bits_equal(out, fmt_oracle.expected(name, x, amax), f"{name} a={a}")
        true_div = torch.from_numpy(_true_division(name, row[None], amax).astype(F32))
        differs += int((out != true_div).sum())
    assert differs > xs.size // 4, f"only {differs} elements show the reciprocal form"


def test_ue8m0_scales_are_the_same_under_either_division():
    """``ceil_to_ue8m0(amax / 448)`` cannot tell the two divisions apart: both quotients are
    monotone in amax, so a difference would need amax within a few ulps of ``448 * 2^k``;
    every such FP32 amax (>= 1e-4, DeepGEMM's floor) rounds to the same power of two."""
    from moewire.formats._numerics import ceil_pow2_ue8m0, mul_recip

    centres = np.ldexp(F32(448.0), np.arange(-21, 119)).astype(F32)
    near = [centres]
    for direction in (np.inf, 0.0):
        v = centres
        for _ in range(4):
            v = np.nextafter(v, F32(direction))
            near.append(v)
    a = torch.from_numpy(np.concatenate(near))
    assert a.min() >= 1e-4 and torch.isfinite(a).all()
    assert not torch.equal(mul_recip(a, 448.0), a / 448.0), "the quotients never differ"
    assert torch.equal(ceil_pow2_ue8m0(mul_recip(a, 448.0)), ceil_pow2_ue8m0(a / 448.0))


@pytest.mark.parametrize("divisor", [448.0, 2688.0, 510.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_mul_recip_multiplies_by_the_correctly_rounded_reciprocal(divisor, dtype):
    from moewire.formats._numerics import mul_recip

    np_t = np.float32 if dtype == torch.float32 else np.float64
    recip = np_t(1.0) / np_t(divisor)  # one division in the tensor's own precision
    t = np.random.default_rng(int(divisor)).uniform(-8.0, 8.0, 4096).astype(np_t)
    got = mul_recip(torch.from_numpy(t), divisor)
    assert got.dtype == dtype
    assert np.array_equal(got.numpy(), t * recip)
    assert not np.array_equal(got.numpy(), t / np_t(divisor)), "no input split the two"
