"""The order of moewire's hooks in one forward that stages inline through DeepGEMM's cast.

The cast stages the tokens; the ids are staged after it, so the dispatch calibration on the
staged tokens runs at the kernel call, *before* the kernel (which may clear the buffer);
the combine hook runs right after the kernel returns. Each event is recorded where it
happens: the cast and the kernel as DeepGEMM's functions, the calibration as the dispatch
quantizer's ``collect``, the combine as the module's combine hook.
"""

from __future__ import annotations

import pytest
import torch
from mm_helpers import SHAPES, batch

from moewire.megamoe import layout_check
from moewire.megamoe.convert import convert, unconvert
from moewire.quantizer import WireQuantizer
from moewire.reference import MegaMoEExperts, deep_gemm

T, E, K = 20, 8, 4


class _InlineExperts(MegaMoEExperts):
    """Stages like vLLM main's ``DeepGemmMegaExperts``: cast, copy, ids, kernel."""

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        from moewire.reference import deep_gemm as dg

        buf, t = self.get_symm_buffer(), hidden_states.shape[0]
        q, sf = dg.utils.per_token_cast_to_fp8(hidden_states, use_ue8m0=True, gran_k=32,
                                              use_packed_ue8m0=True)
        buf.x[:t].copy_(q)
        buf.x_sf[:t].copy_(sf)
        buf.topk_idx[:t].copy_(topk_ids)
        buf.topk_weights[:t].copy_(topk_weights)
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16)
        dg.fp8_fp4_mega_moe(y, self.l1_weights, self.l2_weights, buf)
        return y


@pytest.fixture(scope="module")
def weights_module():
    h, i = SHAPES["fp8xfp4"]
    return _InlineExperts(E, K, h, i, 24, mma_type="fp8xfp4", device="cpu")


@pytest.fixture
def experts(weights_module):
    layout_check.reset_layout_checks()
    module = convert(weights_module, "layers.4.experts")
    yield module
    unconvert(module)
    layout_check.reset_layout_checks()


def _record(events: list[str], label: str, fn):
    def recorded(*args, **kwargs):
        events.append(label)
        return fn(*args, **kwargs)

    return recorded


@pytest.fixture
def events(experts, monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(deep_gemm.utils, "per_token_cast_to_fp8",
                        _record(log, "cast", deep_gemm.utils.per_token_cast_to_fp8))
    monkeypatch.setattr(deep_gemm, "fp8_fp4_mega_moe",
                        _record(log, "kernel", deep_gemm.fp8_fp4_mega_moe))
    monkeypatch.setattr(experts, "_moewire_combine",
                        _record(log, "combine", experts._moewire_combine))
    return log


def _quantizers(experts, calibrate: bool, log: list[str]) -> None:
    for attr in ("dispatch_quantizer", "combine_quantizer"):
        q = WireQuantizer("fp8", constant_amax=None if calibrate else 6.0)
        if attr == "dispatch_quantizer":
            q.collect = _record(log, "calibration", q.collect)
        setattr(experts, attr, q)


def test_calibrating_cast_then_calibration_then_kernel_then_combine(experts, events):
    """Break: collect the cast's calibration after the kernel call: the calibration
    event follows the kernel."""
    _quantizers(experts, calibrate=True, log=events)
    x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=80)
    with experts.dispatch_quantizer.calibrating(), experts.combine_quantizer.calibrating():
        experts(x, w, ids)
    assert events == ["cast", "calibration", "kernel", "combine"]
    assert float(experts.dispatch_quantizer.static_amax) > 0


def test_quantizing_cast_then_kernel_then_combine(experts, events):
    """With fixed amaxes nothing is collected; the cast still precedes the kernel and the
    combine follows it, once each."""
    _quantizers(experts, calibrate=False, log=events)
    x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=81)
    experts(x, w, ids)
    assert events == ["cast", "kernel", "combine"]
