"""moewire on DeepGEMM's real SM90 Mega-MoE kernels (PR #323), on a Hopper GPU.

Each test compares a call's combine rows with the same call's ``y``: the SM90
``fp8_fp4_mega_moe`` is not deterministic across calls (measured on an H200), ``fp8_mega_moe``
is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import rk_cases as rk
import torch

import moewire
from moewire import formats, kernels
from moewire.integrations import deepgemm_sm90 as sm90
from moewire.megamoe import flavours, layout_check
from moewire.megamoe.layout import combine_rows
from moewire.megamoe.registry import ExpertsAdapter, register_experts_class
from moewire.megamoe.resum import resum

pytestmark = pytest.mark.real_kernel

KERNEL_IDS = ["fp8", "fp8xfp4"]
COMBINE_FORMATS = [n for n in kernels.SUPPORTED_FORMATS if formats.get(n).row_local]


def _combine(fmt: str, amax: float | None = None) -> dict:
    cfg = {"format": fmt}
    if formats.get(fmt).needs_amax:
        cfg["constant_amax"] = amax
    return {"quant_cfg": [{"quantizer_name": "*combine_quantizer", "cfg": cfg}]}


# -- the layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", rk.SHAPES, ids=rk.SHAPE_IDS)
@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_layout_rows_resum_to_y_and_check_passes(kernel, shape, ep_group):
    """The rows sit at the tail == end of l2_acts_sf (by data_ptr); moewire's flavour finds
    them; the ascending re-sum is y bit for bit; the bf16-combine layout check passes and
    leaves y identical to the kernel's own."""
    module = rk.experts(kernel, shape, ep_group)
    buf = module.symm_buffer
    assert buf.l2_acts_sf.untyped_storage().data_ptr() != buf.buffer.untyped_storage().data_ptr()
    x, w, ids, single = rk.batch(shape, "layout")
    y = module(x, w, ids)
    rows = rk.rows_of(buf, shape.tokens)
    assert combine_rows(buf, sm90.FLAVOUR, kernel).data_ptr() == rows.data_ptr()
    assert rk.mismatches(rk.oracle(rows, ids), y) == 0
    ours = resum(combine_rows(buf, sm90.FLAVOUR, kernel), ids, shape.tokens)
    assert rk.mismatches(ours, y) == 0
    for tok, slot in enumerate(single):
        assert torch.equal(rows[slot, tok].view(torch.int16), y[tok].view(torch.int16))
    assert not y[-shape.padding :].view(torch.int16).any()
    moewire.quantize(module, _combine("bf16"))
    y_moewire = module(x, w, ids)
    assert layout_check.layout_checked(buf)
    assert rk.mismatches(rk.oracle(rk.rows_of(buf, shape.tokens), ids), y_moewire) == 0
    if kernel == "fp8_mega_moe":  # deterministic: the same y as the kernel alone
        assert rk.mismatches(y_moewire, y) == 0


class _OffByOneRow(sm90.SM90MegaMoEExperts):
    """The real module read with a base rule one token row too early."""


def _off_by_one(symm_buffer, nbytes, flavour):
    return symm_buffer.buffer.numel() - nbytes - 2 * symm_buffer.hidden


@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_layout_check_refuses_a_wrong_base(kernel, ep_group):
    if "rk-off-by-one" not in flavours.names():
        flavours.register_base_rule("rk_off_by_one_row", _off_by_one)
        wrong = flavours.KernelLayout("rk_off_by_one_row", None)
        flavours.register(flavours.Flavour("rk-off-by-one", dict.fromkeys(rk.KERNELS, wrong)))
    register_experts_class(_OffByOneRow, ExpertsAdapter(
        name="rk-off-by-one", forward_module=sm90.__name__, stage_fn="stage_sm90_inputs",
        stage_hidden_arg=0, kernel_ns="deep_gemm", get_symm_buffer=lambda m: m.symm_buffer,
        flavour=lambda m: "rk-off-by-one", fused_shared=lambda m: False,
        ep_group=lambda m: None))
    w1, w2, buf = rk.prepared(kernel, rk.TINY, ep_group)
    module = _OffByOneRow(w1, w2, buf, kernel)
    moewire.quantize(module, _combine("bf16"))
    x, w, ids, _ = rk.batch(rk.TINY, "wrong-base")
    with pytest.raises(RuntimeError, match="layout check failed"):
        module(x, w, ids)
    assert not layout_check.layout_checked(buf)


@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_order_is_ascending_on_crafted_rows(kernel, ep_group):
    """Rows a, -a and a tiny c (experts 0/1 with L2(e1) = -L2(e0), router weights 2^10 and
    2^-8): ascending gives c, descending loses it, and y is the ascending sum."""
    g = torch.Generator(device="cuda").manual_seed(rk.seed_of("order"))
    l1 = torch.randn(8, 2048, 2048, generator=g, device="cuda").bfloat16() * 0.05
    l2 = torch.randn(8, 2048, 1024, generator=g, device="cuda").bfloat16() * 0.05
    l1[1], l2[1] = l1[0], -l2[0]
    module = sm90.SM90MegaMoEExperts.from_bf16(
        l1, l2, kernel=kernel, group=ep_group, max_num_tokens=48, top_k=3)
    ids = torch.tensor([[0, 1, 2]] * 42 + [[-1, -1, -1]] * 6, device="cuda")
    w = torch.tensor([[2.0**10, 2.0**10, 2.0**-8]] * 42 + [[0.0] * 3] * 6, device="cuda")
    x = torch.randn(48, 2048, generator=g, device="cuda").bfloat16()
    y = module(x, w, ids)
    rows = rk.rows_of(module.symm_buffer, 48)
    assert torch.equal(rows[1, :42].view(torch.int16), (-rows[0, :42]).view(torch.int16))
    assert rk.mismatches(rk.oracle(rows, ids), y) == 0
    assert rk.mismatches(rk.oracle(rows, ids, descending=True), y) > 0
    ours = resum(combine_rows(module.symm_buffer, sm90.FLAVOUR, kernel), ids, 48)
    assert rk.mismatches(ours, y) == 0


# -- the combine formats through the fused kernel ---------------------------------------------


@pytest.mark.parametrize("shape", rk.SHAPES, ids=rk.SHAPE_IDS)
@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_every_combine_format_bit_exact_on_the_real_rows(kernel, shape, ep_group):
    """Each row-local combine format through moewire (the fused Triton kernel on CUDA)
    equals the torch reference (format QDQ + the kernel-order re-sum) of the same call's rows."""
    assert kernels.available()
    module = rk.experts(kernel, shape, ep_group)
    x, w, ids, _ = rk.batch(shape, "formats")
    module(x, w, ids)
    amax = rk.valid_amax(rk.rows_of(module.symm_buffer, shape.tokens), ids)
    failures = {}
    for fmt in COMBINE_FORMATS:
        quantized = moewire.quantize(rk.experts(kernel, shape, ep_group), _combine(fmt, amax))
        y = quantized(x, w, ids)
        rows = rk.rows_of(quantized.symm_buffer, shape.tokens)
        bad = rk.mismatches(rk.oracle(rows, ids, fmt, amax), y)
        if bad:
            failures[fmt] = bad
    assert not failures, f"elements differing from the reference per format: {failures}"


# -- the dispatch quantizer -------------------------------------------------------------------


@pytest.mark.parametrize("shape", rk.SHAPES, ids=rk.SHAPE_IDS)
@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_dispatch_quantizer_stages_the_quantized_tokens(fmt, kernel, shape, ep_group):
    """With a dispatch quantizer the kernel reads exactly the staging of fake_quant(x); the
    deterministic kernel's y equals the kernel run on fake_quant(x)."""
    module = rk.experts(kernel, shape, ep_group)
    buf = module.symm_buffer
    x, w, ids, _ = rk.batch(shape, "dispatch")
    amax = float(x.float().abs().max())
    xq = formats.fake_quant(x, fmt, amax if formats.get(fmt).needs_amax else None)
    assert rk.mismatches(xq, x) > 0
    y_ref = module(xq, w, ids)
    staged = (buf.x[: shape.tokens].clone(), buf.x_sf[: shape.tokens].clone())
    cfg = {"format": fmt, **({"constant_amax": amax} if formats.get(fmt).needs_amax else {})}
    moewire.quantize(module, {"quant_cfg": [{"quantizer_name": "*dispatch_quantizer", "cfg": cfg}]})
    y = module(x, w, ids)
    assert torch.equal(buf.x[: shape.tokens].view(torch.int8), staged[0].view(torch.int8))
    assert torch.equal(buf.x_sf[: shape.tokens], staged[1])
    if kernel == "fp8_mega_moe":
        assert rk.mismatches(y, y_ref) == 0
    else:
        assert rk.mismatches(rk.oracle(rk.rows_of(buf, shape.tokens), ids), y) == 0


# -- calibration, then save_scales / load_scales ----------------------------------------------


@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_calibrate_save_load(kernel, ep_group, tmp_path):
    """max over the valid rows only (padding and stale rows excluded), kept through
    save_scales / load_scales; the loaded module quantizes with that amax."""
    shape = rk.SHAPES[1]
    recipe = {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "nvfp4"}},
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}},
    ]}
    batches = [rk.batch(shape, f"calib{i}") for i in range(2)]
    seen = {"rows": 0.0, "x": 0.0}

    def loop(m):
        for x, w, ids, _ in batches:
            y = m(x, w, ids)
            rows = rk.rows_of(m.symm_buffer, shape.tokens)
            seen["rows"] = max(seen["rows"], rk.valid_amax(rows, ids))
            routed = (ids >= 0).any(dim=1)
            seen["x"] = max(seen["x"], float(x[routed].float().abs().max()))
            assert rk.mismatches(rk.oracle(rows, ids), y) == 0  # calibration passes through

    module = rk.experts(kernel, shape, ep_group)
    moewire.quantize(module, recipe, forward_loop=loop)
    assert float(module.combine_quantizer.amax) == seen["rows"]
    assert float(module.dispatch_quantizer.amax) == seen["x"]
    path = moewire.save_scales(module, tmp_path / "scales.safetensors")
    fresh = rk.experts(kernel, shape, ep_group)
    moewire.quantize(fresh, recipe)
    moewire.load_scales(fresh, path)
    assert float(fresh.combine_quantizer.amax) == seen["rows"]
    assert float(fresh.dispatch_quantizer.amax) == seen["x"]
    x, w, ids, _ = rk.batch(shape, "after-load")
    y = fresh(x, w, ids)
    rows = rk.rows_of(fresh.symm_buffer, shape.tokens)
    assert rk.mismatches(rk.oracle(rows, ids, "nvfp4", seen["rows"]), y) == 0


# -- CUDA graphs ------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_cuda_graph_after_padding_only_warmup(kernel, ep_group):
    """Warm-up on an all-padding batch leaves the buffer unchecked; the check is captured
    into the graph; replays equal eager (deterministic kernel) and each replay's y is the
    reference re-sum of its own rows."""
    shape = rk.TINY
    module = rk.experts(kernel, shape, ep_group)
    moewire.quantize(module, _combine("fp8", 64.0))
    x0, w0, ids0, _ = rk.batch(shape, "warmup", padding_only=True)
    assert not module(x0, w0, ids0).view(torch.int16).any()
    assert not layout_check.layout_checked(module.symm_buffer)
    x, w, ids, _ = rk.batch(shape, "graph")
    sx, sw, sids = x0.clone(), w0.clone(), ids0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pytest.warns(UserWarning, match="inside the CUDA graph"):
        module(sx, sw, sids)  # padding-only again: nothing checked, no sync
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sy = module(sx, sw, sids)
    torch.cuda.current_stream().wait_stream(stream)
    sx.copy_(x), sw.copy_(w), sids.copy_(ids)
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        rows = rk.rows_of(module.symm_buffer, shape.tokens)
        assert rk.mismatches(rk.oracle(rows, ids, "fp8", 64.0), sy) == 0
        replays.append(sy.clone())
    y_eager = module(x, w, ids)
    if kernel == "fp8_mega_moe":
        assert rk.mismatches(replays[0], y_eager) == 0
        assert rk.mismatches(replays[1], y_eager) == 0


def test_cuda_graph_replay_with_a_corrupted_row_asserts():
    """A kernel whose rows stop adding up to y (one row changed after the kernel, inside the
    graph) fails the captured layout check on replay with a device-side assert; the same
    child without the corruption replays cleanly."""
    child = Path(__file__).with_name("graph_assert_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {}
    for mode in ("clean", "corrupt"):
        proc = subprocess.run(
            [sys.executable, str(child), "fp8_mega_moe", mode], env=env, capture_output=True,
            text=True, timeout=240)
        runs[mode] = (proc.returncode, proc.stdout[-2000:] + proc.stderr[-4000:])
    assert runs["clean"][0] == 0 and "REPLAYED OK" in runs["clean"][1], runs["clean"][1]
    assert runs["corrupt"][0] != 0, runs["corrupt"][1]
    assert "device-side assert" in runs["corrupt"][1], runs["corrupt"][1]
    assert "REPLAYED OK" not in runs["corrupt"][1]


# -- DG_COMM_KERNEL_DEBUG=1 -------------------------------------------------------------------


@pytest.mark.parametrize("kernel", rk.KERNELS, ids=KERNEL_IDS)
def test_debug_env_zeroes_the_rows_and_moewire_refuses(kernel, ep_group, monkeypatch):
    """The kernel zeroes the whole buffer after each call under DG_COMM_KERNEL_DEBUG=1;
    a combine quantizer is refused before the kernel (rows and check state untouched);
    a dispatch-only module still runs."""
    shape = rk.TINY
    module = rk.experts(kernel, shape, ep_group)
    buf = module.symm_buffer
    x, w, ids, _ = rk.batch(shape, "debug")
    y_plain = module(x, w, ids)
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    y_debug = module(x, w, ids)
    torch.cuda.synchronize()
    assert int(buf.buffer.count_nonzero()) == 0
    if kernel == "fp8_mega_moe":
        assert rk.mismatches(y_debug, y_plain) == 0
    monkeypatch.delenv("DG_COMM_KERNEL_DEBUG")
    module(x, w, ids)
    rows_before = rk.rows_of(buf, shape.tokens).clone()
    assert rows_before.view(torch.int16).any()
    quantized = moewire.quantize(rk.experts(kernel, shape, ep_group), _combine("fp8", 64.0))
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    with pytest.raises(RuntimeError, match="DG_COMM_KERNEL_DEBUG=1 is set"):
        quantized(x, w, ids)
    torch.cuda.synchronize()
    # Refused before the kernel ran: it would have zeroed the rows.
    assert torch.equal(rk.rows_of(buf, shape.tokens).view(torch.int16),
                       rows_before.view(torch.int16))
    assert not layout_check.layout_checked(buf)
    dispatch_only = moewire.quantize(rk.experts(kernel, shape, ep_group), {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp4"}}]})
    assert dispatch_only(x, w, ids).view(torch.int16).any()


# -- fp8_fp4 non-determinism ------------------------------------------------------------------


def test_fp4_kernel_nondeterminism_is_per_call(ep_group, record_property):
    """Repeated calls on the same input: the rows may change between calls, each call's rows
    re-sum to that call's y, and moewire's layout check (fresh each call) passes every time."""
    shape = rk.SHAPES[1]
    module = rk.experts("fp8_fp4_mega_moe", shape, ep_group)
    x, w, ids, _ = rk.batch(shape, "determinism")
    moewire.quantize(module, _combine("bf16"))
    first, changed = None, []
    for _ in range(6):
        layout_check.reset_layout_checks()
        y = module(x, w, ids)
        assert layout_check.layout_checked(module.symm_buffer)
        rows = rk.rows_of(module.symm_buffer, shape.tokens).clone()
        assert rk.mismatches(rk.oracle(rows, ids), y) == 0
        if first is None:
            first = rows
        else:
            changed.append(int(((rows.view(torch.int16) != first.view(torch.int16)).any(-1)
                                & (ids >= 0).T).sum()))
    record_property("rows_changed_vs_first_call", changed)
    record_property("valid_rows", int((ids >= 0).sum()))
