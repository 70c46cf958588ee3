"""vLLM main's Hopper experts contract on the real SM90 kernel (PR #323 under the fork's names).

The module is ``sm90_vllm_main.VllmMainSM90Experts`` (vLLM main's staging and call
signature), registered through moewire's vLLM site entry; the kernel is PR #323's
``fp8_mega_moe`` behind ``moewire.integrations.deepgemm_sm90.fork_names()``, which
``flavours.detect`` reads as ``deepgemm-sm90-fork`` (layout guessed from PR #323: the layout
check proves it here, on PR #323's kernel, not on the fork's). Batches carry padding tokens
(vLLM's ``is_padding``) and EPLB-remapped ids (8 logical experts, 2 physical replicas each).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import rk_cases as rk
import sm90_vllm_main as vm
import torch

import moewire
from moewire import formats
from moewire.integrations import deepgemm_sm90 as sm90
from moewire.megamoe import flavours, layout_check

pytestmark = pytest.mark.real_kernel

SHAPE = rk.TINY  # E 16, H 2048, I 1024, k 6, T 100 (8 padding)
LOGICAL = SHAPE.experts // 2


def _combine(fmt: str, amax: float | None = None) -> dict:
    cfg = {"format": fmt, **({"constant_amax": amax} if amax is not None else {})}
    return {"quant_cfg": [{"quantizer_name": "*combine_quantizer", "cfg": cfg}]}


def make_experts(group) -> vm.VllmMainSM90Experts:
    """A fresh module on the real kernel, with EPLB replicas (logical l -> physical l and
    l + 8) and no padding set."""
    vm.use_kernel(sm90.fork_names())
    module = vm.VllmMainSM90Experts(
        group=group, num_experts=SHAPE.experts, num_local_experts=SHAPE.experts,
        top_k=SHAPE.top_k // 2, hidden_size=SHAPE.hidden, intermediate_size=SHAPE.inter,
        max_num_tokens=SHAPE.tokens, num_logical_experts=LOGICAL, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(rk.seed_of("vllm-main-sm90"))
    e, h, i = SHAPE.experts, SHAPE.hidden, SHAPE.inter
    module.load_bf16(
        torch.randn(e, 2 * i, h, generator=g, device="cuda").mul_(h**-0.5).bfloat16(),
        torch.randn(e, h, i, generator=g, device="cuda").mul_(i**-0.5).bfloat16())
    replicas = torch.arange(e, device="cuda").view(2, LOGICAL).T.contiguous()
    module.set_eplb_state(replicas, torch.full((LOGICAL,), 2, device="cuda"))
    vm.forward_context.is_padding = None
    return module


@pytest.fixture()
def experts(ep_group):
    yield make_experts(ep_group)
    vm.forward_context.is_padding = None


def _batch(tag: str, *, all_padding: bool = False):
    """``(x, w, logical ids, is_padding)``: top-3 of 8 logical experts, the last 8 tokens
    padding (their router output is garbage, as vLLM's), token 0 with one valid slot."""
    t, k = SHAPE.tokens, SHAPE.top_k // 2
    g = torch.Generator(device="cuda").manual_seed(rk.seed_of("vm-batch", tag))
    x = torch.randn(t, SHAPE.hidden, generator=g, device="cuda").bfloat16()
    w, ids = torch.randn(t, LOGICAL, generator=g, device="cuda").softmax(-1).topk(k)
    ids[0, 1:], w[0, 1:] = -1, 0.0
    pad = torch.zeros(t, dtype=torch.bool, device="cuda")
    pad[t - SHAPE.padding :] = True
    if all_padding:
        pad[:] = True
    return x, w, ids, pad


def _staged(module, t):
    buf = module.get_symm_buffer()
    return buf.topk_idx[:t].clone(), buf


def test_combine_bit_exact_with_padding_and_eplb(experts):
    """The unquantized kernel's rows (located by the fork flavour's rule) re-sum to y; with
    moewire: a BF16 combine leaves y bit-identical and marks the buffer checked, an FP8
    combine equals the reference re-sum of the quantized rows over the staged (physical,
    padding -1) ids, and the dispatch quantizer stages exactly fake_quant(x)."""
    x, w, ids, pad = _batch("exact")
    vm.forward_context.is_padding = pad
    y_plain = experts(x, w, ids, activation_clamp=10.0)
    staged, buf = _staged(experts, SHAPE.tokens)
    assert flavours.detect(vm._import_deep_gemm()).name == "deepgemm-sm90-fork"
    assert (staged[pad] == -1).all() and (staged[~pad] >= LOGICAL).any()  # EPLB replicas
    assert not y_plain[pad].view(torch.int16).any()
    rows = rk.rows_of(buf, SHAPE.tokens)
    assert rk.mismatches(rk.oracle(rows, staged), y_plain) == 0

    moewire.quantize(experts, _combine("bf16"))
    assert rk.mismatches(experts(x, w, ids, activation_clamp=10.0), y_plain) == 0
    assert layout_check.layout_checked(buf)

    amax = rk.valid_amax(rows, staged)
    moewire.quantize(experts, _combine("fp8", amax))
    y = experts(x, w, ids, activation_clamp=10.0)
    rows = rk.rows_of(buf, SHAPE.tokens)
    assert rk.mismatches(rk.oracle(rows, staged, "fp8", amax), y) == 0
    assert rk.mismatches(y, y_plain) > 0

    x_amax = float(x.float().abs().max())
    xq = formats.fake_quant(x, "fp8", x_amax)
    experts.combine_quantizer.disable()
    experts.dispatch_quantizer.disable()
    experts(xq, w, ids, activation_clamp=10.0)
    want = (buf.x[: SHAPE.tokens].clone(), buf.x_sf[: SHAPE.tokens].clone())
    moewire.quantize(experts, {"quant_cfg": [{"quantizer_name": "*dispatch_quantizer",
                                              "cfg": {"format": "fp8", "constant_amax": x_amax}}]})
    experts(x, w, ids, activation_clamp=10.0)
    assert torch.equal(buf.x[: SHAPE.tokens].view(torch.int8), want[0].view(torch.int8))
    assert torch.equal(buf.x_sf[: SHAPE.tokens], want[1])


def test_cuda_graph_replay_equals_eager(experts):
    """Warm-up on an all-padding batch leaves the buffer unchecked; the check is captured;
    two replays on a routed batch (padding and EPLB inside the graph) equal eager bit for
    bit and the reference re-sum of their own rows."""
    moewire.quantize(experts, _combine("fp8", 64.0))
    x0, w0, ids0, pad0 = _batch("warm", all_padding=True)
    vm.forward_context.is_padding = pad0
    assert not experts(x0, w0, ids0, activation_clamp=10.0).view(torch.int16).any()
    assert not layout_check.layout_checked(experts.get_symm_buffer())
    sx, sw, sids, spad = x0.clone(), w0.clone(), ids0.clone(), pad0.clone()
    vm.forward_context.is_padding = spad
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pytest.warns(UserWarning, match="inside the CUDA graph"):
        experts(sx, sw, sids, activation_clamp=10.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sy = experts(sx, sw, sids, activation_clamp=10.0)
    torch.cuda.current_stream().wait_stream(stream)
    x, w, ids, pad = _batch("graph")
    sx.copy_(x), sw.copy_(w), sids.copy_(ids), spad.copy_(pad)
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        staged, buf = _staged(experts, SHAPE.tokens)
        assert rk.mismatches(rk.oracle(rk.rows_of(buf, SHAPE.tokens), staged, "fp8", 64.0),
                             sy) == 0
        replays.append(sy.clone())
    y_eager = experts(x, w, ids, activation_clamp=10.0)
    assert rk.mismatches(replays[0], y_eager) == 0
    assert rk.mismatches(replays[1], y_eager) == 0
    assert not y_eager[pad].view(torch.int16).any()


def test_wrong_layout_refused_eager(experts, monkeypatch):
    """A wrong guess of the fork's layout (one token row early) is a clear refusal in eager
    mode, never a wrong y."""
    _register_wrong_layout(monkeypatch)
    monkeypatch.setenv(flavours.ENV_FLAVOUR, WRONG)
    moewire.quantize(experts, _combine("bf16"))
    x, w, ids, pad = _batch("wrong")
    vm.forward_context.is_padding = pad
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(x, w, ids, activation_clamp=10.0)
    assert not layout_check.layout_checked(experts.get_symm_buffer())


WRONG = "rk-fork-off-by-one"


def _register_wrong_layout(monkeypatch=None) -> None:
    """The flavour reading the rows one token row early: for one test (``monkeypatch``), or
    for the child process's life."""
    rule = lambda buf, nbytes, where: buf.buffer.numel() - nbytes - 2 * buf.hidden  # noqa: E731
    if monkeypatch is None:
        flavours.BASE_RULES["rk_fork_off_by_one_row"] = rule
    else:
        monkeypatch.setitem(flavours.BASE_RULES, "rk_fork_off_by_one_row", rule)
    flavour = flavours.Flavour(
        WRONG, {"fp8_mega_moe_sm90": flavours.KernelLayout("rk_fork_off_by_one_row", None)})
    if monkeypatch is None:
        flavours.register(flavour)
    else:
        monkeypatch.setitem(flavours._REGISTRY, WRONG, flavour)


def test_wrong_layout_in_a_cuda_graph_is_a_device_assert():
    """Captured after a padding-only warm-up, the layout check of a wrong layout stops the
    replay with a device-side assert (own process: it kills the CUDA context); the same
    child with the right layout replays cleanly."""
    child = Path(__file__).with_name("sm90_vllm_main_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {}
    for mode in ("right", "wrong"):
        proc = subprocess.run([sys.executable, str(child), mode], env=env, capture_output=True,
                              text=True, timeout=240)
        runs[mode] = (proc.returncode, proc.stdout[-2000:] + proc.stderr[-4000:])
    assert runs["right"][0] == 0 and "REPLAYED OK" in runs["right"][1], runs["right"][1]
    assert runs["wrong"][0] != 0, runs["wrong"][1]
    assert "device-side assert" in runs["wrong"][1], runs["wrong"][1]
    assert "REPLAYED OK" not in runs["wrong"][1]
