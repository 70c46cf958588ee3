"""moewire on the stand-in of DeepGEMM 2.8.0's fp4_fp4_mega_moe on CUDA (skipped without it):
the fused Triton combine on this layout equals the torch re-sum bit for bit, and a quantized
layer captured in a CUDA graph checks its layout on the device.

The speed of the fused combine on this layout against a copy of the same bytes:
``python benchmarks/combine_fp4_fp4.py --out benchmarks/results/combine_fp4_fp4.json``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

import moewire
from moewire import kernels
from moewire.megamoe import layout_check
from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts

pytestmark = pytest.mark.gpu
E, K, H, INTER, T = 8, 3, 512, 512, 24
CASES = {"routed": {}, "shared-rsf": {"num_fused_shared_experts": 1,
                                      "routed_scaling_factor": 0.7}}


@pytest.fixture(autouse=True)
def _fresh():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def _batch(name: str, device: str = "cuda"):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    masked = torch.rand(T, K, generator=g) < 0.25
    return (x.to(device), w.masked_fill(masked, 0.0).to(device),
            ids.masked_fill(masked, -1).to(device))


def _cfg(fmt, amax):
    return {"quant_cfg": [{"quantizer_name": "*combine_quantizer",
                           "cfg": {"format": fmt, "constant_amax": amax}}]}


@pytest.mark.parametrize("fmt,amax", [("nvfp4", 2.0), ("fp8", 2.0), ("mxfp8", None)],
                         ids=["nvfp4", "fp8", "mxfp8"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_combine_on_this_layout_equals_the_torch_resum(case, fmt, amax, monkeypatch):
    """The combine quantizer's re-sum through moewire.kernels.fused_combine (one pass with
    the layout check for ``routed``; the routed rows then the kernel's finish for
    ``shared-rsf``) equals the same forward with the kernels disabled, bit for bit."""
    if not kernels.available():
        pytest.skip("moewire.kernels unavailable (no Triton)")
    calls = []
    real = kernels.fused_combine
    monkeypatch.setattr(kernels, "fused_combine",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w, ids = _batch(f"fused-{case}")
    outs = []
    for disable in (False, True):
        if disable:
            monkeypatch.setenv("MOEWIRE_DISABLE_KERNELS", "1")
        layout_check.reset_layout_checks()
        experts = FP4MegaMoEExperts(E, K, H, INTER, T, device="cuda", seed=1, **CASES[case])
        y_plain = experts(x, w, ids)
        cfg = _cfg(fmt, amax) if amax is not None else {"quant_cfg": [
            {"quantizer_name": "*combine_quantizer", "cfg": {"format": fmt}}]}
        moewire.quantize(experts, cfg)
        outs.append(experts(x, w, ids))
        assert not torch.equal(outs[-1].view(torch.int16), y_plain.view(torch.int16))
        moewire.unquantize(experts)
        if not disable:
            assert calls, "the fused combine did not run"
    n = len(calls)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert len(calls) == n


SCRIPT = textwrap.dedent(
    """
    import dataclasses, sys, torch, warnings
    import moewire
    from moewire.megamoe import flavours, registry
    from moewire.reference import forward_context
    from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts
    sys.path.insert(0, {here!r})
    from test_megamoe_fp4_fp4_gpu import E, K, H, INTER, T, _batch, _cfg

    wrong = {wrong}
    if wrong:
        build = flavours.get("deepgemm-2.8")
        layout = build.layout("fp4_fp4_mega_moe")
        bad = dataclasses.replace(build, name="test-no-routed-scale", kernels={{
            **build.kernels, "fp4_fp4_mega_moe": dataclasses.replace(layout, routed_scale=None)}})
        flavours._REGISTRY[bad.name] = bad
        (adapter,) = registry._ADAPTERS[FP4MegaMoEExperts]
        registry._ADAPTERS[FP4MegaMoEExperts] = (
            dataclasses.replace(adapter, flavour=lambda m: bad.name),)
    experts = FP4MegaMoEExperts(E, K, H, INTER, T, device="cuda", seed=1,
                                num_fused_shared_experts=1, routed_scaling_factor=0.7)
    moewire.quantize(experts, _cfg("nvfp4", 2.0))
    x, w, ids = _batch("graph")
    pad = torch.ones(T, dtype=torch.bool, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), forward_context(is_padding=pad):
        for _ in range(2):
            experts(x, w, ids)  # all padding: the check waits (the shared row alone)
    torch.cuda.current_stream().wait_stream(side)
    pad.fill_(False)
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with forward_context(is_padding=pad), torch.cuda.graph(graph):
            y = experts(x, w, ids)
    assert any("runs inside the CUDA graph" in str(m.message) for m in seen)
    graph.replay()
    torch.cuda.synchronize()
    print("replay returned", flush=True)
    with forward_context(is_padding=pad):
        eager = experts(x, w, ids)
    assert torch.equal(eager.view(torch.int16), y.view(torch.int16))
    print("replay equals eager", flush=True)
    """
)


@pytest.mark.parametrize("wrong", [False, True], ids=["right-layout", "no-routed-scale"])
def test_captured_layer_checks_its_layout_on_the_device(wrong, tmp_path):
    """A quantized layer whose buffer was unchecked at capture (an all-padding warm-up)
    records the layout check in the graph: with the right layout the replay equals the eager
    forward; with a layout lacking the routed_scale step the replay stops with a
    device-side assert (a subprocess: the assert poisons the CUDA context)."""
    script = tmp_path / "replay.py"
    script.write_text(SCRIPT.format(here=os.path.dirname(__file__), wrong=wrong))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if wrong:
        assert proc.returncode != 0 and "replay equals eager" not in proc.stdout
        assert "device-side assert" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "replay equals eager" in proc.stdout


def test_weights_on_the_device_stay_there():
    experts = FP4MegaMoEExperts(E, K, H, INTER, T, device="cuda")
    assert all(t.is_cuda for t in (experts.w13_weight, experts.l1_alphas,
                                   experts.get_symm_buffer().buffer))
