"""flavours, combine_rows and resum against a hand-made buffer and a NumPy oracle."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

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


# (flavour, kernel) -> whether the region has a tail after it (vLLM 0.33's bf16
# combine_norm_buffer), read from DeepGEMM `layout/mega_moe.cuh` independently of moewire's table.
TAILED = {("vllm-0.33", "bf16_mega_moe")}
CASES = [
    ("deepgemm-main", "fp8_fp4_mega_moe", False),
    ("vllm-0.32", "fp8_fp4_mega_moe", False),
    ("vllm-0.32", "fp8_fp4_mega_moe", True),
    ("vllm-0.32", "bf16_mega_moe", True),
    ("vllm-0.33", "fp8_fp4_mega_moe", True),
    ("vllm-0.33", "bf16_mega_moe", False),
    ("vllm-0.33", "bf16_mega_moe", True),
    ("deepgemm-sm90", "fp8_fp4_mega_moe", False),
    ("deepgemm-sm90", "fp8_mega_moe", False),
]
CASE_IDS = [f"{f}-{k.split('_mega')[0]}-{'shared' if s else 'routed'}" for f, k, s in CASES]


def _dlpack(view: torch.Tensor) -> torch.Tensor:
    return torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(view))


def make_buffer(
    fused_shared: bool, seed: int, tail: int = 0, scales: bool = True, dlpack: bool = False
):
    """A flat int8 buffer laid out by hand: junk, l2_acts, [l2_acts_sf], combine, [tail].

    Returns the SymmBuffer-like namespace, the combine rows as float32 NumPy
    ``[num_slots, TMAX, H]`` (BF16 values) and their byte offset, computed here
    independently. ``dlpack``: the views share no storage object with ``.buffer`` (the
    SM90 build's DLPack views), though they point into it.
    """
    g = np.random.default_rng(seed)
    slots = K + int(fused_shared)
    junk, l2_bytes, sf_bytes = 40, 8 * 32, (8 * 4 * 4 if scales else 0)
    comb_bytes = slots * TMAX * H * 2
    total = junk + l2_bytes + sf_bytes + comb_bytes + tail
    raw = g.integers(-128, 128, size=total, dtype=np.int8)
    values = g.standard_normal((slots, TMAX, H)).astype(np.float32)
    bits = bf16_bits(values)
    base = junk + l2_bytes + sf_bytes
    raw[base : base + comb_bytes] = bits.reshape(-1).view(np.int8)
    flat = torch.from_numpy(raw.copy())
    l2_acts = flat[junk : junk + l2_bytes].view(torch.float8_e4m3fn).view(8, 32)
    l2_acts_sf = flat[junk + l2_bytes : base].view(torch.int32).view(8, 4) if scales else None
    if dlpack:
        l2_acts = _dlpack(l2_acts)
        l2_acts_sf = _dlpack(l2_acts_sf) if scales else None
    buf = SimpleNamespace(
        buffer=flat,
        num_max_tokens_per_rank=TMAX,
        num_topk=K,
        hidden=H,
        l2_acts=l2_acts,
        l2_acts_sf=l2_acts_sf,
    )
    return buf, bits.view(ml_dtypes.bfloat16).astype(np.float32), base


@pytest.mark.parametrize("flavour,kernel,fused", CASES, ids=CASE_IDS)
def test_combine_rows_is_the_region_as_a_view(flavour, kernel, fused):
    tail = 96 if (flavour, kernel) in TAILED else 0
    buf, expected, base = make_buffer(fused, seed=1, tail=tail, scales=kernel != "bf16_mega_moe")
    rows = combine_rows(buf, flavour, kernel, fused_shared=fused)
    assert rows.dtype == torch.bfloat16 and rows.shape == (K + fused, TMAX, H)
    np.testing.assert_array_equal(rows.float().numpy(), expected)
    assert rows.data_ptr() == buf.buffer.data_ptr() + base
    buf.buffer[base : base + 2] = torch.tensor([0, 0x7F], dtype=torch.int8)
    assert torch_bits(rows[0, 0, :1])[0] == 0x7F00  # same storage: no copy


def test_tail_rule_is_wrong_where_a_norm_buffer_follows():
    # vLLM 0.33/0.34's bf16 kernel: the combine_norm_buffer follows the combine region, so
    # the tail rule (deepgemm-main's) reads the wrong bytes; the L2 rule finds the region.
    buf, expected, base = make_buffer(True, seed=4, tail=96, scales=False)
    good = combine_rows(buf, "vllm-0.33", "bf16_mega_moe", fused_shared=True)
    assert good.data_ptr() == buf.buffer.data_ptr() + base
    tail_rule = flavours.KernelLayout("last_region", "first")
    assert tail_rule.combine_base(buf, good.numel() * 2, "test") == base + 96


@pytest.mark.parametrize("kernel", ["fp8_fp4_mega_moe", "fp8_mega_moe"])
def test_base_rule_works_on_views_that_share_no_storage(kernel):
    # The SM90 build's views are DLPack tensors; the base is found by data_ptr().
    buf, expected, base = make_buffer(False, seed=5, dlpack=True)
    assert buf.l2_acts_sf.untyped_storage().data_ptr() != buf.buffer.untyped_storage().data_ptr()
    rows = combine_rows(buf, "deepgemm-sm90", kernel)
    assert rows.data_ptr() == buf.buffer.data_ptr() + base
    np.testing.assert_array_equal(rows.float().numpy(), expected)


def test_flavour_registry():
    assert flavours.names() == [
        "deepgemm-2.8", "deepgemm-main", "deepgemm-sm90", "deepgemm-sm90-fork",
        "deepgemm-vllm-dev", "deepgemm-vllm-situ", "sgl-deep-gemm-0.2.3", "sgl-deep-gemm-0.2.5",
        "vllm-0.32", "vllm-0.33"]
    # Stored at slot k everywhere; added last by vLLM 0.32's bundled build, first by 0.33's.
    for kernel in ("fp8_fp4_mega_moe", "bf16_mega_moe"):
        assert flavours.get("vllm-0.32").layout(kernel).shared_position == "last"
        assert flavours.get("vllm-0.33").layout(kernel).shared_position == "first"
    assert flavours.get("vllm-0.33").layout("bf16_mega_moe").base_rule == "after_l2_scales"
    assert flavours.get("deepgemm-main").layout("fp8_fp4_mega_moe").shared_position is None
    assert flavours.get("deepgemm-main").layout("bf16_mega_moe") == flavours.KernelLayout(
        "last_region", None)
    assert not flavours.get("deepgemm-sm90").fuses_shared()
    assert {"fp8_fp4_mega_moe", "bf16_mega_moe", "fp8_mega_moe"} <= flavours.kernel_functions()
    f = flavours.get("vllm-0.33")
    assert flavours.get(f) is f


@pytest.mark.parametrize("old", ["upstream", "vllm", "sgl"])
def test_old_flavour_names_are_refused_with_the_new_one(old):
    with pytest.raises(ValueError, match=f"{old!r} was renamed"):
        flavours.get(old)


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
    "flavour,kernel,fused,damage,match",
    [
        ("vllm-0.32", "fp8_fp4_mega_moe", False, _small, "does not fit"),
        ("vllm-0.33", "fp8_fp4_mega_moe", False, _no_sf, "l2_acts_sf"),
        ("deepgemm-main", "fp8_fp4_mega_moe", True, None, "fuses no shared expert"),
        ("deepgemm-sm90", "bf16_mega_moe", False, None, "has no Mega-MoE kernel 'bf16_mega_moe'"),
        ("vllm-0.32", "fp8_fp4_mega_moe", False, _not_int8, "flat int8"),
        ("vllm-0.32", "fp8_fp4_mega_moe", False, _bad_fields, "num_topk"),
        ("vllm-0.33", "fp8_fp4_mega_moe", False, _foreign_view, "does not lie inside"),
        ("nope", "fp8_fp4_mega_moe", False, None, "unknown kernel flavour 'nope'"),
    ],
    ids=[
        "too-small",
        "no-l2-view",
        "main-shared",
        "kernel-not-in-build",
        "not-int8",
        "bad-field",
        "foreign-view",
        "unknown-flavour",
    ],
)
def test_combine_rows_refusals(flavour, kernel, fused, damage, match):
    buf, _, _ = make_buffer(False, seed=3)
    if damage is not None:
        buf = damage(buf)
    with pytest.raises(ValueError, match=match):
        combine_rows(buf, flavour, kernel, fused_shared=fused)


@pytest.mark.parametrize(
    "args,exc,match",
    [
        (("no_such_rule", None), ValueError, "unknown combine base rule"),
        (("last_region", "middle"), ValueError, "shared_position must be"),
        (("last_region", None, 1), TypeError, "weighted must be a bool"),
    ],
    ids=["bad-rule", "bad-shared-position", "weighted-not-bool"],
)
def test_kernel_layout_refusals(args, exc, match):
    with pytest.raises(exc, match=match):
        flavours.KernelLayout(*args)


def test_flavour_and_register_refusals():
    layout = flavours.KernelLayout("last_region", None)
    with pytest.raises(ValueError, match="at least one kernel"):
        flavours.Flavour("x", {})
    with pytest.raises(TypeError, match="must be a KernelLayout"):
        flavours.Flavour("x", {"k": ("last_region", None)})
    with pytest.raises(ValueError, match="already registered"):
        flavours.register(flavours.Flavour("vllm-0.32", {"fp8_fp4_mega_moe": layout}))
    with pytest.raises(ValueError, match="reserved"):
        flavours.register(flavours.Flavour("vllm", {"fp8_fp4_mega_moe": layout}))
    with pytest.raises(TypeError, match="expected a Flavour"):
        flavours.register("vllm-0.32")
    with pytest.raises(ValueError, match="already registered"):
        flavours.register_base_rule("last_region", lambda b, n, f: 0)


# -- detect: the flavour of an imported DeepGEMM module --------------------------------------


def _module(name, *functions, shared_param=True, version="2.8.1"):
    """A DeepGEMM-like module: ``get_symm_buffer_for_mega_moe`` with or without
    ``num_shared_experts`` (vLLM's bundled copies vs upstream), plus ``functions``."""
    module = ModuleType(name)
    module.__version__ = version

    def kernel(y, l1, l2, sym_buffer):
        return None

    if shared_param:

        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk,
                                         hidden, intermediate_hidden, num_shared_experts=0):
            return None
    else:

        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk,
                                         hidden, intermediate_hidden, use_fp8_dispatch=True):
            return None

    module.get_symm_buffer_for_mega_moe = get_symm_buffer_for_mega_moe
    module.fp8_fp4_mega_moe = kernel
    for fn in functions:
        setattr(module, fn, kernel)
    return module


@pytest.mark.parametrize(
    "module,want",
    [
        (_module("vllm.third_party.deep_gemm", "bf16_mega_moe", "fp4_fp4_mega_moe"), "vllm-0.33"),
        (_module("vllm.third_party.deep_gemm", "bf16_mega_moe", version="2.8.0"), "vllm-0.32"),
        (_module("deep_gemm", shared_param=False), "deepgemm-main"),
        (_module("deep_gemm", "fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe",
                 shared_param=False), "deepgemm-sm90"),
    ],
    ids=["vllm-0.33/0.34-bundled", "vllm-0.32-bundled", "upstream", "sm90-pr323"],
)
def test_detect_reads_the_imported_module(module, want, monkeypatch):
    monkeypatch.delenv(flavours.ENV_FLAVOUR, raising=False)
    assert flavours.detect(module).name == want


def test_detect_reads_the_stand_in_and_honours_the_override(monkeypatch):
    from moewire.reference import deep_gemm

    monkeypatch.delenv(flavours.ENV_FLAVOUR, raising=False)
    with deep_gemm.use_flavour("vllm-0.32"):
        assert flavours.detect(deep_gemm).name == "vllm-0.32"
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "deepgemm-sm90")
    assert flavours.detect(deep_gemm).name == "deepgemm-sm90"


@pytest.mark.parametrize(
    "env,module,exc,match",
    [
        (None, ModuleType("deep_gemm"), RuntimeError, "is no build moewire knows: looked for"),
        ("vllm", ModuleType("deep_gemm"), ValueError, "MOEWIRE_FLAVOUR: kernel flavour 'vllm'"),
        ("nope", ModuleType("deep_gemm"), ValueError, "unknown kernel flavour 'nope'"),
    ],
    ids=["unknown-module", "env-old-name", "env-unknown"],
)
def test_detect_refusals(env, module, exc, match, monkeypatch):
    if env is None:
        monkeypatch.delenv(flavours.ENV_FLAVOUR, raising=False)
    else:
        monkeypatch.setenv(flavours.ENV_FLAVOUR, env)
    with pytest.raises(exc, match=match):
        flavours.detect(module, "layers.0.experts")


# -- resum --------------------------------------------------------------------------------


def oracle_resum(rows, topk_idx, t, shared_slot, quant=None):
    """Per token, a Python loop over the valid slots in ascending order, FP32 accumulate
    with NumPy float32 scalars, shared row (index k) unquantized, one BF16 rounding."""
    slots, _, h = rows.shape
    k = topk_idx.shape[1]
    routed = rows[:k]
    out = np.zeros((t, h), dtype=np.uint16)
    for tok in range(t):
        acc = np.zeros(h, dtype=np.float32)
        terms = []
        if shared_slot == "first":
            terms.append(rows[k, tok])
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
    routed = rows[:K]
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
    got = resum(
        rows, topk_idx, t, shared_position=shared_slot,
        row_quantizer=e4m3_torch if quant else None, out=y,
    )
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
    y = resum(
        rows, topk_idx, 5, shared_position="last",
        row_quantizer=lambda r: seen.append(r.shape) or r * 0,
    )
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


@pytest.mark.parametrize("position", ["first", "last"])
def test_resum_shared_position_is_visible_after_bf16_rounding(position):
    # Routed 2^16, 1, 1 and the shared row (stored at slot k) 2^24. Shared first: 2^24 +
    # 2^16, then each 1 vanishes in FP32 (ties to even at ulp 2), and the BF16 tie rounds
    # to even: 2^24. Shared last: 2^16 + 1 + 1 = 65538 exact, + 2^24 = 16842754, above the
    # BF16 tie: 2^24 + 2^17. Adding the shared row at the wrong end flips the result.
    rows = torch.zeros(4, TMAX, H, dtype=torch.bfloat16)
    for s, v in enumerate([2.0**16, 1.0, 1.0, 2.0**24]):
        rows[s, 0, 0] = v
    topk_idx = torch.zeros(TMAX, 3, dtype=torch.int64)
    y = resum(rows, topk_idx, 1, shared_position=position)[0, 0].item()
    assert y == {"first": 2.0**24, "last": 2.0**24 + 2.0**17}[position]


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
        ({"rows": torch.zeros(K, TMAX, H, dtype=torch.float16)}, ValueError,
         "rows must be a BF16 or FP32"),
        ({"rows": torch.zeros(K, TMAX, H), "row_quantizer": lambda r: r}, ValueError,
         "rows must be a BF16 tensor"),
        ({"topk_idx": torch.zeros(TMAX, K)}, ValueError, "topk_idx must be an integer"),
        ({"shared_position": "middle"}, ValueError, "shared_position must be"),
        ({"shared_position": "last"}, ValueError, "rows has 4 slots"),
        ({"num_tokens": TMAX + 1}, ValueError, "num_tokens=17 must lie"),
        ({"num_tokens": 2.0}, TypeError, "num_tokens must be an int"),
        ({"out": torch.zeros(3, H)}, ValueError, "out must be BF16"),
        ({"out": torch.zeros(4, H, dtype=torch.bfloat16)}, ValueError, "out must be BF16"),
    ],
    ids=[
        "rows-fp16",
        "rows-fp32-quantized",
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


@pytest.mark.parametrize(
    "program",
    [
        "from moewire.megamoe import resum",
        "import moewire.megamoe.resum\nfrom moewire.megamoe import resum",
        "from moewire.megamoe.resum import resum as r\nfrom moewire.megamoe import resum",
        "import moewire.megamoe.layout_check\nfrom moewire.megamoe import resum",
    ],
    ids=["package-first", "submodule-first", "from-submodule-first", "layout-check-first"],
)
def test_package_resum_is_the_function_in_every_import_order(program):
    # Importing the submodule used to leave the package attribute pointing at it.
    import os
    import subprocess
    import sys

    check = program + "\nimport types\nassert isinstance(resum, types.FunctionType), resum\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
