"""vLLM main's NVFP4 x NVFP4 experts (DeepSeek V3.2, GLM-5.2) through moewire's real vLLM
integration: discovery, the bridge, the adapter, on the stand-in of DeepGEMM 2.8.0.

The installed vLLM is 0.32, which has none of main's DeepSeek V3.2 modules: the test loads
``tests/vllm/_main_dsv32.py`` (moewire's module written to main's
``DeepseekV32MegaMoEExperts`` contract, reaching DeepGEMM through vLLM's
``_import_deep_gemm()`` and reading padding from vLLM's forward context) under main's module
name, then runs ``experts_sites()`` and ``register_site()`` as the plugin does. vLLM's
``_import_deep_gemm()`` returns ``moewire.reference.deep_gemm`` imitating ``deepgemm-2.8``.
Checked: the build detected, the combine quantized (bit for bit with a BF16 combine, the
oracle's re-sum of the buffer's last bytes with NVFP4), calibration through
``moewire.quantize`` leaving padding tokens out, the dispatch quantizer before the staging
call, and ``unquantize``.
"""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path

import pytest
import torch

import moewire
from moewire.integrations.vllm import bridge as _vllm_bridge
from moewire.megamoe import layout_check
from moewire.reference import deep_gemm

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
MAIN_V32 = "vllm.models.deepseek_v32.nvidia.mega_moe"
SOURCE = Path(__file__).with_name("_main_dsv32.py")
E, K, H, INTER, T = 8, 3, 512, 512, 16
_layers = iter(range(700, 800))


@pytest.fixture()
def main_v32(vllm_config, monkeypatch):
    """The contract module under vLLM main's name; DeepGEMM = the 2.8.0 stand-in."""
    spec = importlib.util.spec_from_file_location(MAIN_V32, SOURCE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, MAIN_V32, module)
    spec.loader.exec_module(module)
    _vllm_bridge.set_kernel_override(lambda: deep_gemm)
    layout_check.reset_layout_checks()
    with deep_gemm.use_flavour("deepgemm-2.8"):
        assert _register() is module.DeepseekV32MegaMoEExperts
        yield module
    _vllm_bridge.set_kernel_override(None)
    layout_check.reset_layout_checks()


def _register() -> type:
    """Discover main's class by structure and register it, as the plugin does (again after
    ``unquantize``, which gives vLLM its own ``_import_deep_gemm`` back)."""
    found = dict((site.cls_name, (cls, site)) for cls, site in vllm_mod.experts_sites())
    cls, site = found["DeepseekV32MegaMoEExperts"]
    vllm_mod.register_site(cls, site)
    return cls


def _experts(module, config):
    return module.DeepseekV32MegaMoEExperts(
        config, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
        hidden_size=H, intermediate_size=INTER, prefix=f"model.layers.{next(_layers)}.mlp.experts",
    )


def _batch(name: str):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[[2, T - 1]] = True
    # Padding rows far above the rest: an amax that saw them would show it.
    return torch.where(pad[:, None], x * 1000, x), w, ids, pad


def _forward(config, experts, x, w, ids, pad):
    from vllm.forward_context import create_forward_context, override_forward_context

    with override_forward_context(create_forward_context(None, config, is_padding=pad)):
        return experts(x, w, ids)


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _last_rows(buf) -> torch.Tensor:
    """BF16 ``[k, T, H]``: the routed rows, read from the buffer's last bytes (2.8.0's
    combine region is its last)."""
    nbytes = buf.num_slots * buf.num_max_tokens_per_rank * H * 2
    tail = buf.buffer[buf.buffer.numel() - nbytes :].view(torch.bfloat16)
    return tail.view(buf.num_slots, -1, H)[:K, :T]


def test_v32_found_registered_and_its_combine_quantized(main_v32, vllm_config):
    experts = _experts(main_v32, vllm_config)
    x, w, ids, pad = _batch("combine")
    y_plain = _forward(vllm_config, experts, x, w, ids, pad)
    assert vllm_mod.kernel_flavour(experts) == "deepgemm-2.8"
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    assert _same(_forward(vllm_config, experts, x, w, ids, pad), y_plain)
    buf = experts.get_symm_buffer()
    assert layout_check.layout_checked(buf) and not (buf.topk_idx[[2, T - 1]] >= 0).any()
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer",
         "cfg": {"format": "nvfp4", "constant_amax": 2.0}}]})
    y = _forward(vllm_config, experts, x, w, ids, pad)
    rows = moewire.formats.get("nvfp4").reference(_last_rows(buf), torch.tensor(2.0))
    acc = torch.zeros(T, H)
    for s in range(K):
        acc = torch.where((buf.topk_idx[:T, s] >= 0)[:, None], acc + rows[s].float(), acc)
    assert _same(y, acc.bfloat16()) and not _same(y, y_plain)
    moewire.unquantize(experts)
    assert type(experts) is main_v32.DeepseekV32MegaMoEExperts
    assert not hasattr(experts, "combine_quantizer")
    _register()
    assert _same(_forward(vllm_config, experts, x, w, ids, pad), y_plain)


def test_v32_calibrated_without_padding_and_dispatch_before_staging(main_v32, vllm_config):
    """moewire.quantize with a forward loop under vLLM's forward context: both amaxes leave
    the padding tokens out; then the dispatch quantizer acts on the staged tokens only."""
    experts = _experts(main_v32, vllm_config)
    x, w, ids, pad = _batch("calib")
    seen = {}

    def loop(model):
        _forward(vllm_config, model, x, w, ids, pad)
        buf = model.get_symm_buffer()
        valid = buf.topk_idx[:T] >= 0
        seen["dispatch"] = x[valid.any(dim=1)].float().abs().max()
        seen["combine"] = buf.combine_rows()[:K, :T][valid.T].float().abs().max()

    moewire.quantize(experts, "moe_fp8_dispatch_nvfp4_combine", loop)
    assert float(experts.dispatch_quantizer.static_amax) == float(seen["dispatch"]) < 100
    assert float(experts.combine_quantizer.static_amax) == float(seen["combine"])
    amax = experts.dispatch_quantizer.static_amax
    moewire.unquantize(experts)
    _register()
    xq = moewire.formats.fake_quant(x, "fp8", amax)
    y_on_xq = _forward(vllm_config, experts, xq, w, ids, pad)
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer",
         "cfg": {"format": "fp8", "constant_amax": float(amax)}}]})
    routed = ~pad
    y = _forward(vllm_config, experts, x, w, ids, pad)
    assert _same(y[routed], y_on_xq[routed])
    moewire.unquantize(experts)
