"""SGLang 0.5.23's released SM100 Mega-MoE path (``mega_moe.run_mega_routed_experts``:
SGLang's own fp8xfp4 cast, then ``deep_gemm.fp8_fp4_mega_moe``) quantized through moewire's
SGLang integration, on the CPU stand-ins (``_standin.sm100_module``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moewire
from moewire.integrations import sglang as sg
from moewire.megamoe import layout_check
from moewire.megamoe.flavours import get
from moewire.megamoe.layout import combine_rows
from moewire.reference.weights import make_weights

pytestmark = pytest.mark.sglang

T, H, INTER, E, K = 10, 512, 512, 4, 3


@pytest.fixture(autouse=True)
def _small_cap(monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", "16")


class Experts(nn.Module):
    """What SGLang's SM100 path reads of ``moe.experts`` after
    ``build_mega_moe_experts_weights`` (FP4 weights, UE8M0 per 32, transformed)."""

    def __init__(self) -> None:
        super().__init__()
        weights = make_weights(E, H, INTER, seed=7)
        self.num_experts = E
        self._mega_moe_weights_built = True
        self._mega_moe_nvfp4 = False  # set by SGLang's FusedMoE.__init__
        self._mega_moe_w4a4 = False
        self.mega_l1_weights, self.mega_l2_weights = weights.l1, weights.l2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    masked = torch.rand(T, K, generator=g) < 0.3
    masked[-2:] = True
    return x, ids.masked_fill(masked, -1), w.masked_fill(masked, 0.0)


def run(mega_moe, experts, x, ids, w, rsf=1.0):
    return mega_moe.run_mega_routed_experts(
        experts, x, ids, w, hidden_size=H, intermediate_size=INTER, top_k=K,
        num_tokens=x.shape[0], routed_scaling_factor=rsf)


def ascending_sum(rows, ids):
    acc = torch.zeros(T, H)
    for s in range(K):
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + rows[s, :T].float(), acc)
    return acc.bfloat16()


def test_combine_quantized_and_scaling_folded(sglang_sm100):
    model = Model()
    x, ids, w = batch(1)
    plain = run(sglang_sm100, model.experts, x, ids, w, 2.5)
    [buf] = sglang_sm100._MEGA_MOE_SYMM_BUFFER.values()
    rows = combine_rows(buf, get("sgl-deep-gemm-0.2.5"), "fp8_fp4_mega_moe")
    assert torch.equal(plain.view(torch.int16), ascending_sum(rows, ids).view(torch.int16))
    assert torch.equal(buf.topk_weights[:T], w * 2.5)  # SGLang folds it before staging
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    y = run(sglang_sm100, model.experts, x, ids, w, 2.5)
    assert layout_check.layout_checked(buf)
    want = ascending_sum(moewire.formats.fake_quant(rows[:, :T], "mxfp8"), ids)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert not y[-2:].view(torch.int16).any()


def test_dispatch_through_sglangs_own_cast(sglang_sm100):
    """The dispatch quantizer runs in SGLang's own staging call (the rebound global), so the
    kernel sees the quantized tokens: equal to a plain run on them."""
    model = Model()
    x, ids, w = batch(2)
    want = run(sglang_sm100, model.experts, moewire.formats.fake_quant(x, "mxfp4"), ids, w)
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp4"}}]})
    y = run(sglang_sm100, model.experts, x, ids, w)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(y.view(torch.int16), run_plain(sglang_sm100, x, ids, w))


def run_plain(mega_moe, x, ids, w):
    return run(mega_moe, Model().experts, x, ids, w).view(torch.int16)


def test_calibration_sees_the_staged_tokens(sglang_sm100, tmp_path):
    model = Model()
    x, ids, w = batch(3)
    x[-1] = 1000.0  # a padding token (no valid slot): outside the dispatch amax
    sg.quantize_sglang_model(model, "moe_fp8")
    with sg.calibrating(model, str(tmp_path / "s{rank}.pt")):
        run(sglang_sm100, model.experts, x, ids, w)
    valid = (ids >= 0).any(dim=1)
    amax = model.experts.dispatch_quantizer.static_amax
    assert float(amax) == float(x[valid].float().abs().max())
