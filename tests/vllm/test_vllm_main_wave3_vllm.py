"""vLLM main's third wave through moewire's real vLLM integration (discovery, bridge, adapter).

- Kimi-K3's experts written to vLLM main's contract (``_main_kimi_vllm.py``, on vLLM 0.32's
  real ``DeepseekV4MegaMoEExperts``): found by the main site entry, registered through the
  real bridge, run on the stand-in build whose SiTU spelling main's call uses
  (``deepgemm-vllm-situ``), quantized, calibrated and undone at latent width.
- vLLM 0.32's own ROCm class (``vllm/models/deepseek_v4/amd/mega_moe.py``:
  ``DeepseekV4AiterMegaMoEExperts``, aiter's MegaMoEV2): recognised by its module, refused.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path

import _standin as standin
import _vllm_world as _setup
import pytest
import torch

import moewire
from moewire import formats
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import layout_check

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
vllm_quantize = pytest.importorskip("moewire.integrations.vllm.quantize")
MODULE = "moewire_test_vllm_main.kimi_k3_model"
SOURCE = Path(__file__).with_name("_main_kimi_vllm.py")
E, K, H, INTER = _setup.E, _setup.K, _setup.H, _setup.INTER
_layer_ids = itertools.count(900)


@pytest.fixture()
def main_kimi(monkeypatch, vllm_config):
    """main's Kimi-K3 module (vLLM 0.32 has its own at main's path: loaded apart), found
    through the main site entry and registered through the real bridge."""
    spec = importlib.util.spec_from_file_location(MODULE, SOURCE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, MODULE, module)
    spec.loader.exec_module(module)
    site = next(s for s in vllm_sites.SITES
                if s.cls_name == "KimiK3MegaMoEExperts" and "fp8_fp4_mega_moe(" in s.calls)
    site = dataclasses.replace(site, module=MODULE)
    found = vllm_mod.experts_sites((site,))
    assert found == [(module.KimiK3MegaMoEExperts, site)]
    vllm_mod.register_site(module.KimiK3MegaMoEExperts, site)
    layout_check.reset_layout_checks()
    yield module
    layout_check.reset_layout_checks()


def _experts(module, vllm_config):
    prefix = f"model.layers.{next(_layer_ids)}.ffn.experts"
    experts = module.KimiK3MegaMoEExperts(
        vllm_config, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
        hidden_size=H, intermediate_size=INTER, prefix=prefix, activation="situ",
        activation_beta=4.0, activation_linear_beta=25.0)
    checkpoint = _setup.make_experts(vllm_config, prefix=prefix + ".ckpt", seed=3)
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        getattr(experts, name).data.copy_(getattr(checkpoint, name).data)
    return experts


def test_kimi_k3_main_quantized_calibrated_and_undone(main_kimi, vllm_config, monkeypatch):
    """On the stand-in of the build main's call is spelled for: the plain forward is the
    kernel's own combine; calibrated with moewire's recipe, the dispatch quantizer reached
    vLLM's staging global through the bridge (the staged tokens are those of q(x)), the
    combine re-sums NVFP4 rows with the calibrated amax; the first-launch barrier ran once;
    ``moewire.unquantize`` gives the plain output back."""
    import vllm.utils.deep_gemm as vllm_deep_gemm

    from moewire.reference import deep_gemm

    barriers = []
    real_barrier = torch.distributed.barrier
    monkeypatch.setattr(torch.distributed, "barrier",
                        lambda *a, **k: (barriers.append(k.get("group")), real_barrier(*a, **k)))
    experts = _experts(main_kimi, vllm_config)
    model = torch.nn.ModuleDict({"experts": experts})
    x, ids, w = _setup.routing(12, seed=81)
    with standin.use_reference_deep_gemm("deepgemm-vllm-situ"):
        assert vllm_mod.kernel_flavour(experts) == "deepgemm-vllm-situ"
        y_plain = experts(x, w, ids, activation_clamp=None)
        buffer = experts.get_symm_buffer()
        assert buffer.activation == "situ"
        rows = _setup.oracle_rows(buffer, K)
        assert torch.equal(y_plain.view(torch.int16),
                           _setup.oracle_resum(rows, buffer.topk_idx, 12).view(torch.int16))

        def loop(m):
            for seed in (82, 83):
                xs, i, ws = _setup.routing(12, seed=seed)
                m["experts"](xs, ws, i, activation_clamp=None)

        moewire.quantize(model, "moe_fp8_dispatch_nvfp4_combine", forward_loop=loop)
        amax_d = experts.dispatch_quantizer.static_amax
        amax_c = experts.combine_quantizer.static_amax
        want_d = max(float(_setup.routing(12, seed=s)[0].float().abs().max()) for s in (82, 83))
        assert float(amax_d) == want_d
        y = experts(x, w, ids, activation_clamp=None)
        staged = buffer.x[:12].clone()
        rows = _setup.oracle_rows(buffer, K)[:, :12].clone()
        expected = _setup.oracle_resum(formats.fake_quant(rows, "nvfp4", amax_c),
                                       buffer.topk_idx, 12)
        assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
        # A plain layer of the same shape shares the buffer (the class's cache): run on
        # q(x), it stages what the quantized forward staged.
        twin = _experts(main_kimi, vllm_config)
        twin(formats.fake_quant(x, "fp8", amax_d), w, ids, activation_clamp=None)
        assert twin.get_symm_buffer() is buffer
        assert torch.equal(buffer.x[:12].view(torch.int8), staged.view(torch.int8))
        assert not torch.equal(y.view(torch.int16), y_plain.view(torch.int16))
        assert layout_check.layout_checked(buffer)
        namespace = vllm_deep_gemm._import_deep_gemm()
    moewire.unquantize(model)
    # Undone: the class is vLLM's own again, its quantizers gone. (vLLM's DeepGEMM lookup and
    # the staging global are put back once no converted module lives in the process; other
    # tests' may.) On CPU vLLM's own cannot run (Triton staging, no DeepGEMM): the stand-ins
    # are put in their place by hand, and the layer gives its plain output.
    assert type(experts) is main_kimi.KimiK3MegaMoEExperts
    assert not hasattr(experts, "dispatch_quantizer")
    monkeypatch.setattr(vllm_deep_gemm, "_import_deep_gemm", lambda: namespace)
    monkeypatch.setattr(main_kimi, "prepare_megamoe_inputs",
                        standin.prepare_megamoe_inputs_reference)
    if not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    with deep_gemm.use_flavour("deepgemm-vllm-situ"):
        y_undone = experts(x, w, ids, activation_clamp=None)
    assert torch.equal(y_undone.view(torch.int16), y_plain.view(torch.int16))
    assert len(barriers) == 1


def test_the_installed_aiter_experts_are_refused_before_conversion(vllm_config):
    """vLLM 0.32's ROCm Mega-MoE class is found by its module's structure (aiter imported in
    its weight finalisation) and refused, naming its backend and the switch."""
    from vllm.models.deepseek_v4.amd.mega_moe import DeepseekV4AiterMegaMoEExperts

    found = dict((cls, site) for cls, site in vllm_mod.experts_sites())
    site = found[DeepseekV4AiterMegaMoEExperts]
    assert site.refusal == vllm_sites.AITER_REFUSAL
    layer = object.__new__(DeepseekV4AiterMegaMoEExperts)
    torch.nn.Module.__init__(layer)
    model = torch.nn.ModuleDict({"ffn": layer})
    with pytest.raises(RuntimeError, match=r"moewire: ffn is a vllm\.models\.deepseek_v4\.amd"
                       r"\.mega_moe\.DeepseekV4AiterMegaMoEExperts.*--moe-backend "
                       r"flydsl_mega_moe.*--moe-backend deep_gemm_mega_moe"):
        vllm_quantize._refuse_sites(model, list(found.items()))
