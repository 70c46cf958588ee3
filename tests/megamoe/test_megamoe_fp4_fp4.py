"""moewire on DeepGEMM 2.8.0's NVFP4 x NVFP4 Mega-MoE (``fp4_fp4_mega_moe``): the combine
re-summed in the kernel's order (the routed sum rounded and scaled before a fused shared row,
``KernelLayout.routed_scale``), its layout check, calibration and the refusals of the
re-sum's new step.

The stand-in is ``moewire.reference.fp4_fp4.experts.FP4MegaMoEExperts`` (vLLM main's V3.2
forward) on the ``deepgemm-2.8`` flavour.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import moewire
from moewire import formats
from moewire.megamoe import api, flavours, layout_check, registry
from moewire.megamoe.resum import resum
from moewire.reference import deep_gemm
from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts

E, K, H, INTER, T = 8, 3, 512, 512, 24
CASES = {
    "plain": {},
    "rsf": {"routed_scaling_factor": 2.5},
    "shared": {"num_fused_shared_experts": 1},
    "shared-rsf": {"num_fused_shared_experts": 1, "routed_scaling_factor": 0.7},
}


@pytest.fixture(autouse=True)
def _build():
    layout_check.reset_layout_checks()
    with deep_gemm.use_flavour("deepgemm-2.8"):
        yield
    layout_check.reset_layout_checks()


def _batch(name: str):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    masked = torch.rand(T, K, generator=g) < 0.25
    masked[-2:] = True
    return x, w.masked_fill(masked, 0.0), ids.masked_fill(masked, -1)


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _combine(fmt, amax=None):
    cfg = {"format": fmt, **({"constant_amax": amax} if amax is not None else {})}
    return {"quant_cfg": [{"quantizer_name": "*combine_quantizer", "cfg": cfg}]}


def _oracle(rows, ids, fmt, amax, shared, rsf):
    """q(rows) summed ascending in FP32 over valid slots; then, as the kernel, the sum
    rounded to BF16 and scaled when shared or rsf != 1, the (unquantized) shared row last."""
    q = formats.get(fmt).reference(rows[:K, :T], torch.tensor(amax)).float()
    acc = torch.zeros(T, H)
    for s in range(K):
        acc = torch.where((ids[:, s] >= 0).unsqueeze(1), acc + q[s], acc)
    if shared or rsf != 1.0:
        acc = acc.bfloat16().float()
        if rsf != 1.0:
            acc = (acc * rsf).bfloat16().float()
        if shared:
            acc = acc + rows[K, :T].float()
    return acc.bfloat16()


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_combine_is_quantized_in_the_kernels_order(name):
    """BF16 combine: bit for bit the kernel's y (the layout check passes); FP8 combine: the
    oracle's re-sum of the kernel's own rows, the shared row (never on the wire) unquantized.
    Break: drop routed_scale from the deepgemm-2.8 fp4_fp4 layout."""
    kwargs = CASES[name]
    experts = FP4MegaMoEExperts(E, K, H, INTER, T, device="cpu", **kwargs)
    x, w, ids = _batch(f"order-{name}")
    y_plain = experts(x, w, ids)
    rows = experts.get_symm_buffer().combine_rows().clone()
    moewire.quantize(experts, _combine("bf16"))
    assert _same(experts(x, w, ids), y_plain)
    assert layout_check.layout_checked(experts.get_symm_buffer())
    moewire.unquantize(experts)
    amax = float(rows[:K, :T][(ids >= 0).T].float().abs().max())
    moewire.quantize(experts, _combine("fp8", amax))
    y = experts(x, w, ids)
    shared = bool(kwargs.get("num_fused_shared_experts"))
    want = _oracle(rows, ids, "fp8", amax, shared, kwargs.get("routed_scaling_factor", 1.0))
    assert _same(y, want) and not _same(y, y_plain)


@pytest.mark.parametrize("name", ["rsf", "shared", "shared-rsf"], ids=["rsf", "shared",
                                                                        "shared-rsf"])
def test_a_layout_without_the_routed_scale_step_fails_the_check(name, monkeypatch):
    """The same layout without its routed_scale step (one rounding at the end, the factor
    nowhere) does not reproduce the kernel's y on these batches: refused, never a wrong
    number."""
    build = flavours.get("deepgemm-2.8")
    layout = build.layout("fp4_fp4_mega_moe")
    wrong = dataclasses.replace(build, name="test-no-routed-scale", kernels={
        **build.kernels, "fp4_fp4_mega_moe": dataclasses.replace(layout, routed_scale=None)})
    monkeypatch.setitem(flavours._REGISTRY, wrong.name, wrong)
    (adapter,) = registry._ADAPTERS[FP4MegaMoEExperts]
    monkeypatch.setitem(registry._ADAPTERS, FP4MegaMoEExperts,
                        (dataclasses.replace(adapter, flavour=lambda m: wrong.name),))
    experts = FP4MegaMoEExperts(E, K, H, INTER, T, device="cpu", **CASES[name])
    moewire.quantize(experts, _combine("bf16"))
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(*_batch(f"wrong-{name}"))


def test_calibration_collects_the_valid_routed_rows_only():
    experts = FP4MegaMoEExperts(E, K, H, INTER, T, device="cpu", num_fused_shared_experts=1)
    x, w, ids = _batch("calib")
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "fp8"}}]})
    with api.calibrating(experts):
        experts(x, w, ids)
    rows = experts.get_symm_buffer().combine_rows()
    want = rows[:K, :T][(ids >= 0).T].float().abs().max()
    assert float(experts.combine_quantizer.static_amax) == float(want)
    assert float(rows[K, :T].float().abs().max()) != float(want)  # the shared row stays out


class _PositionalScale(FP4MegaMoEExperts):
    """Passes routed_scaling_factor positionally (DeepGEMM's 16th parameter)."""

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        t = hidden_states.shape[0]
        buf = self.get_symm_buffer()
        from moewire.reference.fp4_fp4 import experts as module

        module.prepare_megamoe_nvfp4_inputs(hidden_states, topk_weights, topk_ids, buf.x[:t],
                                            buf.x_sf[:t], buf.topk_idx[:t],
                                            buf.topk_weights[:t])
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16)
        module.deep_gemm.fp4_fp4_mega_moe(
            y, self.l1_weights, self.l2_weights, buf, None, None, None, None, (1, 1, 16),
            "swiglu", None, True, self.l1_alphas, self.l2_alphas, None, self.scale)
        return y


def test_the_factor_is_read_from_a_positional_call():
    """DeepGEMM's 16th parameter passed positionally is read (the re-sum reproduces y)."""
    experts = _PositionalScale(E, K, H, INTER, T, device="cpu")
    experts.scale = 1.75
    x, w, ids = _batch("positional")
    y_plain = experts(x, w, ids)
    moewire.quantize(experts, _combine("bf16"))
    assert _same(experts(x, w, ids), y_plain)


def _kernel(y, l1, l2, buf, routed_scaling_factor=1.0): ...


@pytest.mark.parametrize(
    ("args", "kwargs", "fused", "want"),
    [((None,) * 4 + (2.0,), {}, False, 2.0),
     ((None,) * 4, {"routed_scaling_factor": 3.0}, False, 3.0),
     ((None,) * 4, {}, False, None), ((None,) * 4, {}, True, 1.0),
     ((None,) * 4 + (0.1,), {}, False, float(torch.tensor(0.1)))],
    ids=["positional", "keyword", "default-identity", "default-with-shared", "fp32-value"],
)
def test_routed_scale_value(args, kwargs, fused, want):
    """By position, keyword or default; the identity (1 without a shared row) is None; the
    factor is its FP32 value, as the kernel's C float."""
    from moewire.megamoe.quant_experts import _routed_scale

    layout = flavours.get("deepgemm-2.8").layout("fp4_fp4_mega_moe")
    assert _routed_scale("l", layout, "k", (_kernel, args, kwargs), fused) == want


@pytest.mark.parametrize("value", [float("inf"), torch.tensor(2.0), True],
                         ids=["inf", "tensor", "bool"])
def test_a_factor_moewire_cannot_resum_with_is_refused(value):
    from moewire.megamoe.quant_experts import _routed_scale

    layout = flavours.get("deepgemm-2.8").layout("fp4_fp4_mega_moe")
    with pytest.raises(RuntimeError, match="finite Python float"):
        _routed_scale("l", layout, "k", (_kernel, (None,) * 4, {"routed_scaling_factor": value}),
                      False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"shared_position": "first"}, "shared_position='first' has no such step"),
     ({"weights": torch.ones(T, K)}, "weighted rows"),
     ({"routed_scale": float("nan")}, "finite float")],
    ids=["shared-first", "weights", "nan"],
)
def test_resum_routed_scale_refusals(kwargs, match):
    rows = torch.randn(K + 1, T, H).bfloat16()
    ids = torch.zeros(T, K, dtype=torch.int64)
    args = {"routed_scale": 2.0, "shared_position": "last", **kwargs}
    with pytest.raises(ValueError, match=match):
        resum(rows, ids, T, **args)


def test_a_routed_scale_layout_takes_no_shared_first_or_weights():
    from moewire.megamoe.builds import KernelLayout

    for kwargs in ({"shared_position": "first"}, {"shared_position": None, "weighted": True}):
        with pytest.raises(ValueError, match="routed_scale step"):
            KernelLayout("after_l2_scales", routed_scale="routed_scaling_factor", **kwargs)
