"""SGLang 0.5.23's released ``run_sm90_mega_routed`` quantized through moewire's SGLang
integration on DeepGEMM PR #323's real SM90 kernel (``sglang_cases``): the staging of
moewire's pre-dispatch equals PR #323's own, a bit-exact combine, a routed scaling factor
other than 1, padding tokens, CUDA-graph replay equal to eager, and the device-side assert
of the captured layout check on rows that do not add up (a child process)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moewire
from moewire import patches
from moewire.integrations import sglang as sg
from moewire.megamoe import layout_check, registry

pytestmark = [pytest.mark.gpu, pytest.mark.real_kernel]


@pytest.fixture
def sgl(ep_group):
    import sglang_cases as sc

    saved = dict(sys.modules)
    before = dict(registry._ADAPTERS)
    real = importlib.import_module("deep_gemm")
    try:
        sm90, own = sc.load_sglang()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield sc, sm90, own
    finally:
        patches.undo_all()
        registry._ADAPTERS.clear()
        registry._ADAPTERS.update(before)
        if own is not None:
            real.mega_moe_pre_dispatch_sm90 = own
        for name in set(sys.modules) - set(saved):
            if name == "sglang" or name.startswith("sglang."):
                sys.modules.pop(name)


def _batch(sc, tag):
    x, w, ids, _ = sc.rk.batch(sc.SHAPE, tag)
    return x, w, ids


def test_own_pre_dispatch_equals_pr323s(sgl, ep_group):
    sc, _, own = sgl
    if own is None:
        pytest.skip("this DeepGEMM has no mega_moe_pre_dispatch_sm90 of its own")
    buf = sc.Experts(ep_group).buf
    x, w, ids = _batch(sc, "pre-dispatch")
    t = x.shape[0]
    outs = []
    for fn in (own, importlib.import_module("deep_gemm").mega_moe_pre_dispatch_sm90):
        views = (buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights)
        for v in views:
            v.view(torch.uint8).fill_(0x5A)
        fn(x, ids.int(), w.float(), *views, num_tokens=t, group_size=128,
           routed_scaling_factor=2.5)
        torch.cuda.synchronize()
        outs.append([v.clone() for v in views])
    names = ("x", "x_sf", "topk_idx", "topk_weights")
    for name, a, b in zip(names, outs[0], outs[1], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_bit_exact_combine_scaling_and_padding(sgl, ep_group):
    sc, sm90, _ = sgl
    model = sc.Model(ep_group)
    x, w, ids = _batch(sc, "exact")
    rsf = 2.5
    plain = sc.run(sm90, model.experts, x, w, ids, rsf)
    rows_plain = sc.rk.rows_of(model.experts.buf, x.shape[0]).clone()
    assert torch.equal(plain.view(torch.int16), sc.rk.oracle(rows_plain, ids).view(torch.int16))
    assert torch.equal(model.experts.buf.topk_weights[: x.shape[0]],
                       w.float() * torch.tensor(rsf, device="cuda"))
    # Dispatch MXFP8 and combine MXFP8: the kernel on the quantized tokens, rows re-summed.
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp8"}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    y = sc.run(sm90, model.experts, x, w, ids, rsf)
    rows = sc.rk.rows_of(model.experts.buf, x.shape[0])
    assert layout_check.layout_checked(model.experts.buf)
    assert torch.equal(y.view(torch.int16), sc.rk.oracle(rows, ids, "mxfp8").view(torch.int16))
    model.experts.combine_quantizer.disable()
    on_quantized = sc.run(sm90, model.experts, x, w, ids, rsf)
    model.experts.dispatch_quantizer.disable()
    want = sc.run(sm90, model.experts, moewire.formats.fake_quant(x, "mxfp8"), w, ids, rsf)
    assert torch.equal(on_quantized.view(torch.int16), want.view(torch.int16))
    padding = slice(x.shape[0] - sc.SHAPE.padding, x.shape[0])
    assert not y[padding].view(torch.int16).any()
    assert not torch.equal(y.view(torch.int16), plain.view(torch.int16))


def test_cuda_graph_replay_equals_eager(sgl, ep_group):
    sc, sm90, _ = sgl
    model = sc.Model(ep_group)
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "fp8",
                                                         "constant_amax": 64.0}}]})
    x0, w0, ids0, _ = sc.rk.batch(sc.SHAPE, "warmup", padding_only=True)
    sc.run(sm90, model.experts, x0, w0, ids0)
    x, w, ids = _batch(sc, "graph")
    sx, sw, sids = x0.clone(), w0.clone(), ids0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pytest.warns(UserWarning, match="inside the CUDA graph"):
        sc.run(sm90, model.experts, sx, sw, sids)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sy = sc.run(sm90, model.experts, sx, sw, sids, 2.5)
    torch.cuda.current_stream().wait_stream(stream)
    sx.copy_(x), sw.copy_(w), sids.copy_(ids)
    graph.replay()
    torch.cuda.synchronize()
    replayed = sy.clone()
    eager = sc.run(sm90, model.experts, x, w, ids, 2.5)
    assert eager.view(torch.int16).any()
    assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16))


def test_wrong_layout_asserts_on_the_device():
    """Rows that stop adding up to y (one row changed after the kernel, inside the graph)
    fail the captured layout check on replay with a device-side assert; the same child
    without the change replays cleanly."""
    child = Path(__file__).with_name("sglang_assert_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {}
    for mode in ("clean", "corrupt"):
        proc = subprocess.run([sys.executable, str(child), mode], env=env, capture_output=True,
                              text=True, timeout=240)
        runs[mode] = (proc.returncode, proc.stdout[-2000:] + proc.stderr[-4000:])
    if "SKIP" in runs["clean"][1]:
        pytest.skip(runs["clean"][1][-300:])
    assert runs["clean"][0] == 0 and "REPLAYED OK" in runs["clean"][1], runs["clean"][1]
    assert runs["corrupt"][0] != 0, runs["corrupt"][1]
    assert "device-side assert" in runs["corrupt"][1], runs["corrupt"][1]
    assert "REPLAYED OK" not in runs["corrupt"][1]
