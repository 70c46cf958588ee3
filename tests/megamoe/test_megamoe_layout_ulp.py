"""The layout check is bit for bit: one BF16 ulp, or a build summing in another order, fails it.

The stand-in builds here are test-only variants of the stand-in kernel: they run it, then
change one ulp of ``y`` or of one row, or recompute ``y`` in another order on rows where
the order shows (``A + C == A`` in FP32). A control build summing in the kernel's own order
passes, so the crafted data is not what fails the check.
"""

from __future__ import annotations

import mm_oracles as oracles
import pytest
import torch
from mm_helpers import SHAPES, Model, batch, region

import order_cases
from bitexact import assert_same_bits, seed_of
from moewire.megamoe import flavours, layout_check
from moewire.megamoe.convert import convert
from moewire.megamoe.layout_check import layout_checked
from moewire.quantizer import WireQuantizer
from moewire.reference import MegaMoEExperts, deep_gemm
from moewire.reference.builds import KERNEL_BUILDS

T = 20
A, C = 2.0**20, 2.0**-6
# Exactly one routed token differs: the check counts it, at one ulp as at any other size.
ONE_TOKEN = r"layout check failed.*\(1 of \d+ compared tokens differ\)"


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def experts_with_combine(fused: int = 0, mma: str = "bf16xbf16") -> MegaMoEExperts:
    model = Model(n=1, mma=mma, fused=fused)
    for name, module in model.named_modules():
        if isinstance(module, MegaMoEExperts):
            convert(module, name)
    experts = model.layers[0].experts
    experts.combine_quantizer = WireQuantizer("mxfp8")
    return experts


def inputs(seed: int, hidden: int = SHAPES["bf16xbf16"][0]):
    """A batch whose token 0 routes to every slot and token 1 to slot 0 only."""
    x, w, ids = batch(T, hidden, seed=seed)
    ids[0] = torch.arange(ids.shape[1])
    ids[1] = -1
    ids[1, 0] = 5
    return x, w, ids


def one_ulp_up(t: torch.Tensor) -> None:
    """Add one BF16 ulp to a scalar BF16 view in place (a nonzero, finite value)."""
    t.copy_((t.view(torch.int16) + 1).view(torch.bfloat16))


def run_variant(monkeypatch, experts, variant, seed, kernel_name="bf16_mega_moe"):
    real = getattr(deep_gemm, kernel_name)

    def kernel(y, l1, l2, buf, **kwargs):
        result = real(y, l1, l2, buf, **kwargs)
        variant(y, buf)
        return result

    monkeypatch.setattr(deep_gemm, kernel_name, kernel)
    hidden = SHAPES[deep_gemm.MMA_OF_KERNEL[kernel_name]][0]
    return experts(*inputs(seed, hidden=hidden))


def test_y_one_ulp_off_fails_the_check(monkeypatch):
    experts = experts_with_combine()

    def y_off(y, buf):
        one_ulp_up(y[0, 7])

    with pytest.raises(RuntimeError, match=ONE_TOKEN):
        run_variant(monkeypatch, experts, y_off, seed=21)
    assert not layout_checked(experts.get_symm_buffer())


def test_one_row_one_ulp_off_fails_the_check(monkeypatch):
    """Token 1 has one valid slot, so its re-sum is its row: one ulp there is one ulp in y."""
    experts = experts_with_combine()

    def row_off(y, buf):
        assert int((buf.topk_idx[1] >= 0).sum()) == 1
        one_ulp_up(region(buf)[0, 1, 11])

    with pytest.raises(RuntimeError, match=ONE_TOKEN):
        run_variant(monkeypatch, experts, row_off, seed=22)


def summing_build(order: str, shared_at: str | None):
    """A stand-in build that recomputes ``y`` from the rows it wrote, in ``order``
    ("ascending" or "descending") with a fused shared row (stored at slot k) added
    ``shared_at`` ("first"/"last"), after crafting token 0 so that the order shows: its
    columns 0..31 are cleared (one MX block, so a row quantizer keeps the crafted values
    exact), column 3 holds A, -A, C, 0 in the routed slots (ascending C, descending 0) and
    column 5 holds A, -A, 0, 0 with the shared row C (shared last C, first 0)."""

    def variant(y, buf):
        rows = region(buf)
        k, t = buf.num_topk, y.shape[0]
        rows[:, 0, :32] = 0.0
        rows[:k, 0, 3] = torch.tensor([A, -A, C, 0.0])
        rows[:k, 0, 5] = torch.tensor([A, -A, 0.0, 0.0])
        if shared_at is not None:
            rows[k, 0, 5] = C
        valid = buf.topk_idx[:t] >= 0
        slots = range(k) if order == "ascending" else range(k - 1, -1, -1)
        acc = torch.zeros(y.shape, dtype=torch.float32)
        if shared_at == "first":
            acc = acc + rows[k, :t].float()
        for s in slots:
            acc = torch.where(valid[:, s : s + 1], acc + rows[s, :t].float(), acc)
        if shared_at == "last":
            acc = acc + rows[k, :t].float()
        y.copy_(acc.bfloat16())

    return variant


def test_a_build_summing_descending_fails_the_check(monkeypatch):
    experts = experts_with_combine()
    with pytest.raises(RuntimeError, match=ONE_TOKEN):
        run_variant(monkeypatch, experts, summing_build("descending", None), seed=23)


# Where each build adds a fused shared row (DeepGEMM main, vLLM 0.32-0.34's bundled copies),
# written here independently
# of moewire's flavour table; every registered flavour must be listed.
SHARED_POSITION = {"deepgemm-main": None, "vllm-0.32": "last", "vllm-0.33": "first",
                   "deepgemm-sm90": None, "deepgemm-sm90-fork": None, "deepgemm-2.8": "first",
                   # sgl-deep-gemm: impls/sm100_fp8_fp4_mega_moe.cuh of each wheel.
                   "sgl-deep-gemm-0.2.3": "last", "sgl-deep-gemm-0.2.5": "first",
                   # vllm-project/DeepGEMM: impls/sm100_fp8_fp4_mega_moe.cuh at 63aa62a (dev)
                   # and at 51655f2 (the 2.6.1 SiTU line).
                   "deepgemm-vllm-dev": "first", "deepgemm-vllm-situ": "last"}
# The builds whose FP8 x FP4 / BF16 kernels the stand-in imitates (of DeepGEMM 2.8.0 it has
# only fp4_fp4_mega_moe, tested in tests/megamoe/test_megamoe_fp4_fp4.py).
IMITATED = sorted(name for name, build in KERNEL_BUILDS.items()
                  if {"fp8_fp4_mega_moe", "bf16_mega_moe"} & set(build.kernels))
FUSING = [name for name, position in SHARED_POSITION.items()
          if position is not None and name in IMITATED]


def test_every_flavour_is_listed_here():
    assert sorted(SHARED_POSITION) == flavours.names()


@pytest.mark.parametrize("flavour", FUSING)
def test_a_build_adding_the_shared_row_at_the_other_end_fails_the_check(monkeypatch, flavour):
    other = "first" if SHARED_POSITION[flavour] == "last" else "last"
    kernel = KERNEL_BUILDS[flavour].kernels[-1]
    with deep_gemm.use_flavour(flavour):
        experts = experts_with_combine(fused=1, mma=deep_gemm.MMA_OF_KERNEL[kernel])
        with pytest.raises(RuntimeError, match=ONE_TOKEN):
            run_variant(monkeypatch, experts, summing_build("ascending", other), seed=24,
                        kernel_name=kernel)


# The fork's stand-in is a module of its own (moewire.reference.sm90_fork), run through the
# wrapper by tests/real_kernel/test_vllm_main_sm90_cpu.py.
@pytest.mark.parametrize("flavour", sorted(set(SHARED_POSITION) & set(IMITATED)))
def test_every_flavour_through_the_wrapper(monkeypatch, flavour):
    """Positive: each build, summing in its build's order on rows where the order shows, passes
    the layout check, and the quantized re-sum equals the oracle in that order (and not
    in any other order)."""
    position = SHARED_POSITION[flavour]
    fused = int(position is not None)
    kernel = deep_gemm.KERNEL_BUILDS[flavour].kernels[-1]
    mma = deep_gemm.MMA_OF_KERNEL[kernel]
    with deep_gemm.use_flavour(flavour):
        experts = experts_with_combine(fused=fused, mma=mma)
        real = getattr(deep_gemm, kernel)
        variant = summing_build("ascending", position)

        def build(y, l1, l2, buf, **kwargs):
            result = real(y, l1, l2, buf, **kwargs)
            variant(y, buf)
            return result

        monkeypatch.setattr(deep_gemm, kernel, build)
        seed = seed_of("flavour", flavour)
        x, w, ids = inputs(seed, hidden=SHAPES[mma][0])
        y = experts(x, w, ids)
    buf = experts.get_symm_buffer()
    assert layout_checked(buf)
    rows = oracles.to_np(region(buf))
    k, t = buf.num_topk, y.shape[0]
    args = (oracles.mxfp8(rows[:k]), rows[k] if fused else None, ids.numpy(), t)
    want = order_cases.oracle(*args, position)
    assert_same_bits(y, want, seed=seed, what=f"{flavour}: y vs the oracle in its build's order")
    assert float(y[0, 3]) == C and float(y[0, 5]) == (C if position == "last" else 0.0)
    for name, wrong in order_cases.wrong_variants(position).items():
        if name in ("round-each-add", "float64-acc"):  # tests/megamoe/test_megamoe_order.py
            continue
        differs = order_cases.oracle(*args, **{"position": position, **wrong}) != want
        assert differs.any(), f"{flavour}: the data does not separate {name}"


@pytest.mark.parametrize("fused", [0, 1], ids=["routed", "fused-shared"])
def test_control_build_in_the_kernel_order_passes(monkeypatch, fused):
    experts = experts_with_combine(fused=fused)  # the stand-in's default build: vllm-0.33
    variant = summing_build("ascending", SHARED_POSITION["vllm-0.33"] if fused else None)
    run_variant(monkeypatch, experts, variant, seed=25)
    assert layout_checked(experts.get_symm_buffer())
