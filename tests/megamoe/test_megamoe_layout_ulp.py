"""The layout check is bit for bit: one BF16 ulp, or a build summing in another order, fails it.

The stand-in builds here are test-only variants of the stand-in kernel: they run it, then
change one ulp of ``y`` or of one row, or recompute ``y`` in another order on rows where
the order shows (``A + C == A`` in FP32). A control build summing in the kernel's own order
passes, so the crafted data is not what fails the check.
"""

from __future__ import annotations

import pytest
import torch
from mm_helpers import SHAPES, Model, batch, region

from moewire.megamoe import wrapper
from moewire.megamoe.wrapper import convert, layout_checked
from moewire.quantizer import WireQuantizer
from moewire.reference import MegaMoEExperts, deep_gemm

T = 20
A, C = 2.0**20, 2.0**-6
# Exactly one routed token differs: the check counts it, at one ulp as at any other size.
ONE_TOKEN = r"layout check failed.*\(1 of \d+ routed tokens differ\)"


@pytest.fixture(autouse=True)
def fresh_checks():
    wrapper.reset_layout_checks()
    yield
    wrapper.reset_layout_checks()


def experts_with_combine(fused: int = 0) -> MegaMoEExperts:
    model = Model(n=1, fused=fused)
    for name, module in model.named_modules():
        if isinstance(module, MegaMoEExperts):
            convert(module, name)
    experts = model.layers[0].experts
    experts.combine_quantizer = WireQuantizer("mxfp8")
    return experts


def inputs(seed: int):
    """A batch whose token 0 routes to every slot and token 1 to slot 0 only."""
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=seed)
    ids[0] = torch.arange(ids.shape[1])
    ids[1] = -1
    ids[1, 0] = 5
    return x, w, ids


def one_ulp_up(t: torch.Tensor) -> None:
    """Add one BF16 ulp to a scalar BF16 view in place (a nonzero, finite value)."""
    t.copy_((t.view(torch.int16) + 1).view(torch.bfloat16))


def run_variant(monkeypatch, experts, variant, seed):
    real = deep_gemm.bf16_mega_moe

    def kernel(y, l1, l2, buf, **kwargs):
        result = real(y, l1, l2, buf, **kwargs)
        variant(y, buf)
        return result

    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", kernel)
    return experts(*inputs(seed))


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
    ``shared_at`` ("first"/"last"), after crafting token 0 so that the order shows:
    column 3 holds A, -A, C, 0 in the routed slots (ascending C, descending 0) and column
    5 holds A, -A, 0, 0 with the shared row C (shared last C, first 0)."""

    def variant(y, buf):
        rows = region(buf)
        k, t = buf.num_topk, y.shape[0]
        rows[:k, 0, 3] = torch.tensor([A, -A, C, 0.0])
        rows[:k, 0, 5] = torch.tensor([A, -A, 0.0, 0.0])
        if shared_at is not None:
            rows[k, 0, 3], rows[k, 0, 5] = 0.0, C
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


def test_a_build_adding_the_shared_row_first_fails_a_shared_last_check(monkeypatch):
    experts = experts_with_combine(fused=1)  # the stand-in's default flavour adds it last
    with pytest.raises(RuntimeError, match=ONE_TOKEN):
        run_variant(monkeypatch, experts, summing_build("ascending", "first"), seed=24)


@pytest.mark.parametrize("fused", [0, 1], ids=["routed", "fused-shared"])
def test_control_build_in_the_kernel_order_passes(monkeypatch, fused):
    experts = experts_with_combine(fused=fused)
    variant = summing_build("ascending", "last" if fused else None)
    run_variant(monkeypatch, experts, variant, seed=25)
    assert layout_checked(experts.get_symm_buffer())
