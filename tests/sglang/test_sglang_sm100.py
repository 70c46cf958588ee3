"""SGLang 0.5.23's released SM100 Mega-MoE path (``mega_moe.run_mega_routed_experts``:
SGLang's own fp8xfp4 cast, then ``deep_gemm.fp8_fp4_mega_moe``) quantized through moewire's
SGLang integration, on the CPU stand-ins (``_sgl_standin.sm100_module``)."""

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


# -- W4A4: a dispatch quantizer before deep_gemm.mega_moe_pre_dispatch's own 4-bit cast --------

#: SGLang's W4A4 kinds and the group size it stages them with (``run_mega_routed_experts``).
W4A4 = {"nvfp4xnvfp4": 16, "mxf4xmxf4": 32}
DISPATCH_MXFP8 = {"quant_cfg": [
    {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp8"}}]}


class W4A4Buffer:
    """sgl-deep-gemm's SM100 ``SymmBuffer`` views that SGLang's W4A4 staging writes
    (``deep_gemm/mega/__init__.py``): packed E2M1 ``x`` ``[Tmax, H/2]``, the scale bytes
    ``x_sf`` int32 ``[Tmax, H/group/4]``, NVFP4's per-token ``x_scales`` FP32 ``[Tmax]``."""

    def __init__(self, num_experts, tmax, num_topk, hidden, mma_type):
        self.num_experts, self.num_max_tokens_per_rank = num_experts, tmax
        self.num_topk, self.hidden, self.mma_type = num_topk, hidden, mma_type
        self.x = torch.zeros(tmax, hidden // 2, dtype=torch.uint8)
        self.x_sf = torch.zeros(tmax, hidden // W4A4[mma_type] // 4, dtype=torch.int32)
        self.x_scales = torch.zeros(tmax)
        self.topk_idx = torch.zeros(tmax, num_topk, dtype=torch.int64)
        self.topk_weights = torch.zeros(tmax, num_topk)


@pytest.fixture
def w4a4(sglang_sm100, monkeypatch):
    """The SM100 stand-in with W4A4 buffers and a kernel that records the staged tokens
    (moewire has no stand-in of the W4A4 kernels: only the staging is checked)."""
    import sys

    dg = sys.modules["deep_gemm"]
    allocate = dg.get_symm_buffer_for_mega_moe
    staged = []

    def get_symm_buffer_for_mega_moe(group, num_experts, tmax, num_topk, hidden,
                                     intermediate_hidden, num_shared_experts=0,
                                     mma_type="fp8xfp4", activation="swiglu"):
        if mma_type not in W4A4:
            return allocate(group, num_experts, tmax, num_topk, hidden, intermediate_hidden,
                            num_shared_experts, mma_type, activation)
        return W4A4Buffer(num_experts, tmax, num_topk, hidden, mma_type)

    def fp8_fp4_mega_moe(y, l1_weights, l2_weights, buf, **kwargs):
        staged.append((buf.x.clone(), buf.x_sf.clone(), buf.x_scales.clone(), kwargs))
        y.zero_()

    monkeypatch.setattr(dg, "get_symm_buffer_for_mega_moe", get_symm_buffer_for_mega_moe)
    monkeypatch.setattr(dg, "fp8_fp4_mega_moe", fp8_fp4_mega_moe)
    return sglang_sm100, staged


def w4a4_model(mma: str) -> Model:
    """Experts as SGLang's ``FusedMoE.__init__`` marks a W4A4 checkpoint (the alphas are what
    the kernel reads; the recording kernel ignores them)."""
    model = Model()
    experts = model.experts
    experts._mega_moe_nvfp4 = mma == "nvfp4xnvfp4"
    experts._mega_moe_w4a4 = mma == "mxf4xmxf4"
    experts._mega_moe_trtllm_layout = False
    experts.mega_l1_alphas = experts.mega_l2_alphas = torch.ones(E)
    experts.mega_l2_act_scales = torch.ones(E)
    return model


@pytest.mark.parametrize("mma", list(W4A4), ids=["nvfp4", "mxfp4"])
def test_w4a4_wire_carries_the_4bit_cast_of_the_quantized_tokens(w4a4, mma):
    """The dispatch quantizer runs before the kernel's own cast: the staged codes, scale
    bytes and per-token scales are the sgl-deep-gemm cast (an independent NumPy/ml_dtypes
    oracle) of ``q(x)``, not of ``x``."""
    from test_sgl_staging import sm100_oracle

    mega_moe, staged = w4a4
    model = w4a4_model(mma)
    x, ids, w = batch(4)
    sg.quantize_sglang_model(model, DISPATCH_MXFP8)
    run(mega_moe, model.experts, x, ids, w)
    [(buf_x, buf_sf, buf_scales, kwargs)] = staged
    assert kwargs["recipe"] == (1, 1, W4A4[mma])
    got = (buf_x[:T].numpy(), buf_sf.view(torch.uint8)[:T].numpy(), buf_scales[:T].numpy())
    quantized = moewire.formats.fake_quant(x, "mxfp8")
    for tokens, equal in ((quantized, True), (x, False)):
        codes, sf_bytes, pts = sm100_oracle(tokens.float().numpy(), mma, W4A4[mma])
        same = (got[0] == codes).all() and (got[1] == sf_bytes).all() and (
            pts is None or (got[2] == pts).all())
        assert same == equal, "q(x)" if equal else "x: the data cannot tell q(x) from x"


@pytest.mark.parametrize("mma", list(W4A4), ids=["nvfp4", "mxfp4"])
def test_w4a4_dispatch_quantizer_fails_closed(w4a4, monkeypatch, mma):
    """SGLang reaching a DeepGEMM moewire has not hooked (its staging cast unseen): the
    enabled dispatch quantizer did not run, and the forward is an error."""
    import sys
    import types

    mega_moe, staged = w4a4
    model = w4a4_model(mma)
    sg.quantize_sglang_model(model, DISPATCH_MXFP8)
    unhooked = types.SimpleNamespace(**{n: getattr(sys.modules["deep_gemm"], n)
                                        for n in dir(sys.modules["deep_gemm"])
                                        if not n.startswith("__")})
    monkeypatch.setitem(sys.modules, "deep_gemm", unhooked)
    with pytest.raises(RuntimeError, match="without reaching moewire's staging hook.*"
                                           "dispatch_quantizer did not run"):
        run(mega_moe, model.experts, *batch(5))
    assert len(staged) == 1  # SGLang staged and ran the kernel, unquantized


@pytest.mark.parametrize("mma", list(W4A4), ids=["nvfp4", "mxfp4"])
def test_w4a4_calibration_sees_the_staged_tokens(w4a4, tmp_path, mma):
    mega_moe, _ = w4a4
    model = w4a4_model(mma)
    x, ids, w = batch(6)
    x[-1] = 1000.0  # a padding token (no valid slot): outside the dispatch amax
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}}]})
    with sg.calibrating(model, str(tmp_path / "s{rank}.pt")):
        run(mega_moe, model.experts, x, ids, w)
    valid = (ids >= 0).any(dim=1)
    amax = model.experts.dispatch_quantizer.static_amax
    assert float(amax) == float(x[valid].float().abs().max())
