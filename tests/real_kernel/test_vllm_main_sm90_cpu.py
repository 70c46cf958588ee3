"""vLLM main's Hopper experts contract on CPU: ``sm90_vllm_main.VllmMainSM90Experts`` (the
module the real-kernel tier runs on an H200) against ``moewire.reference.sm90_fork``, the
stand-in of the fork's three names, with padding tokens and EPLB-remapped ids."""

from __future__ import annotations

import types
import zlib

import pytest
import sm90_vllm_main as vm
import torch

import moewire
from moewire import formats
from moewire.megamoe import flavours, layout_check
from moewire.reference import sm90_fork

E, LOGICAL, H, INTER, K, T, PAD = 8, 4, 256, 128, 3, 40, 6


def _seed(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


@pytest.fixture()
def experts(patches_undone):
    vm.use_kernel(sm90_fork)
    module = vm.VllmMainSM90Experts(
        group=None, num_experts=E, num_local_experts=E, top_k=K, hidden_size=H,
        intermediate_size=INTER, max_num_tokens=T, num_logical_experts=LOGICAL)
    g = _seed("weights")
    module.load_bf16((torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5).bfloat16(),
                     (torch.randn(E, H, INTER, generator=g) * INTER**-0.5).bfloat16())
    module.set_eplb_state(torch.arange(E).view(2, LOGICAL).T.contiguous(),
                          torch.full((LOGICAL,), 2))
    layout_check.reset_layout_checks()
    yield module
    vm.forward_context.is_padding = None
    layout_check.reset_layout_checks()


def _batch(tag: str):
    g = _seed("batch", tag)
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, LOGICAL, generator=g).softmax(-1).topk(K)
    ids[0, 1:], w[0, 1:] = -1, 0.0
    pad = torch.zeros(T, dtype=torch.bool)
    pad[-PAD:] = True
    # Padding tokens carry huge values: an amax that saw them would be wrong by far.
    x[pad] *= 1000
    return x, w, ids, pad


def _resum(rows, ids, fmt=None, amax=None):
    rows = rows if fmt is None else formats.fake_quant(rows, fmt, amax)
    acc = torch.zeros(rows.shape[1], H)
    for s in range(K):
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + rows[s].float(), acc)
    return acc.bfloat16()


def _rows(module):
    buf = module.get_symm_buffer()
    tail = buf.buffer[buf.buffer.numel() - K * buf.num_max_tokens_per_rank * H * 2 :]
    return tail.view(torch.bfloat16).view(K, -1, H)[:, :T], buf.topk_idx[:T].clone()


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_detected_as_the_fork_and_combine_is_bit_exact(experts):
    """Break: a flavour reading one row early, or a descending re-sum, fails this."""
    x, w, ids, pad = _batch("exact")
    vm.forward_context.is_padding = pad
    y_plain = experts(x, w, ids, activation_clamp=10.0)
    rows, staged = _rows(experts)
    assert flavours.detect(sm90_fork).name == "deepgemm-sm90-fork"
    assert (staged[pad] == -1).all() and (staged[~pad] >= LOGICAL).any()
    assert _same(_resum(rows, staged), y_plain)
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    assert _same(experts(x, w, ids, activation_clamp=10.0), y_plain)
    assert layout_check.layout_checked(experts.get_symm_buffer())
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    y = experts(x, w, ids, activation_clamp=10.0)
    rows, staged = _rows(experts)
    assert _same(_resum(rows, staged, "mxfp8"), y) and not _same(y, y_plain)


def test_dispatch_and_calibration_skip_padding(experts):
    """The inline cast stages fake_quant(x) of the routed tokens; both amaxes come from
    valid rows only (padding tokens are 1000x). Break: collecting all tokens fails it."""
    x, w, ids, pad = _batch("calib")
    vm.forward_context.is_padding = pad
    recipe = {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "fp8"}}]}
    moewire.quantize(experts, recipe,
                     forward_loop=lambda m: m(x, w, ids, activation_clamp=10.0))
    assert float(experts.dispatch_quantizer.amax) == float(x[~pad].float().abs().max())
    rows, staged = _rows(experts)
    assert float(experts.combine_quantizer.amax) == float(rows.float()[(staged >= 0).T].abs().max())
    amax = float(experts.dispatch_quantizer.amax)
    y = experts(x, w, ids, activation_clamp=10.0)
    buf = experts.get_symm_buffer()
    want = sm90_fork.utils.per_token_cast_to_fp8(formats.fake_quant(x, "fp8", amax),
                                                 use_ue8m0=False, gran_k=128)
    assert torch.equal(buf.x[:T].view(torch.int8), want[0].view(torch.int8))
    rows, staged = _rows(experts)
    assert _same(_resum(rows, staged, "fp8", float(experts.combine_quantizer.amax)), y)


def _off_by_one(buf, nbytes, where):
    return buf.buffer.numel() - nbytes - 2 * buf.hidden


def test_wrong_layout_guess_is_refused(experts, monkeypatch):
    """A wrong guess of the fork's layout: a clear refusal, y never replaced."""
    monkeypatch.setitem(flavours.BASE_RULES, "cpu_fork_off_by_one", _off_by_one)
    monkeypatch.setitem(flavours._REGISTRY, "cpu-fork-off-by-one", flavours.Flavour(
        "cpu-fork-off-by-one",
        {"fp8_mega_moe_sm90": flavours.KernelLayout("cpu_fork_off_by_one", None)}))
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "cpu-fork-off-by-one")
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    x, w, ids, _ = _batch("wrong")
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(x, w, ids, activation_clamp=10.0)
    assert not layout_check.layout_checked(experts.get_symm_buffer())


@pytest.mark.parametrize(
    "names",
    [("fp8_mega_moe_sm90",), ("fp8_mega_moe_sm90", "transform_weights_for_mega_moe_sm90")],
    ids=["kernel-only", "no-buffer"],
)
def test_missing_fork_functions_refused(names):
    """A DeepGEMM with part of the fork's names is no build moewire knows."""
    module = types.ModuleType("deep_gemm")
    for name in names:
        setattr(module, name, lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="transform_weights_for_mega_moe_sm90 "
                                           r"\(deepgemm-sm90-fork"):
        flavours.detect(module, "layer0")


def test_pr323_under_its_own_names_is_not_the_fork():
    """PR #323's package (get_symm_buffer_for_sm90_mega_moe, no fp8_mega_moe_sm90) stays
    deepgemm-sm90, whose kernels do not include the fork's."""
    module = types.ModuleType("deep_gemm")
    for name in ("fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe",
                 "transform_weights_for_mega_moe_sm90"):
        setattr(module, name, lambda *a, **k: None)
    flav = flavours.detect(module)
    assert flav.name == "deepgemm-sm90"
    with pytest.raises(ValueError, match="has no Mega-MoE kernel 'fp8_mega_moe_sm90'"):
        flav.layout("fp8_mega_moe_sm90")


def test_a_cast_bound_at_import_fails_closed(experts, monkeypatch):
    """A forward casting with a function bound before the hook (not looked up on the
    module) is not quantized silently: the dispatch hook was never reached."""
    bound = sm90_fork.utils.per_token_cast_to_fp8
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8", "constant_amax": 8.0}}]})
    monkeypatch.setattr(vm, "deep_gemm", types.SimpleNamespace(
        utils=types.SimpleNamespace(per_token_cast_to_fp8=bound),
        fp8_mega_moe_sm90=sm90_fork.fp8_mega_moe_sm90,
        get_symm_buffer_for_sm90_mega_moe=sm90_fork.get_symm_buffer_for_sm90_mega_moe,
        transform_weights_for_mega_moe_sm90=sm90_fork.transform_weights_for_mega_moe_sm90,
        moewire_flavour=sm90_fork.moewire_flavour))
    with pytest.raises(RuntimeError, match=r"staging hook \(the staging call, through the first .*"
                                           r"per_token_cast_to_fp8 of \[T, hidden\] tokens"):
        experts(*_batch("bound")[:3], activation_clamp=10.0)
