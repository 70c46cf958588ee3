"""vLLM's FlashInfer MoE-EP modular experts: recognised by module path and refused.

vLLM 0.34.0 and main (33f1263) run FlashInfer's ``moe_ep`` megakernel as a modular experts
object, ``FlashInferMoeEpExperts`` of ``vllm/model_executor/layers/fused_moe/experts/
flashinfer_moe_ep.py``, held by the MoE layer at ``quant_method.moe_kernel.fused_experts``
(as gpt-oss's ``DeepGemmMegaExperts``). Its ``process_weights_after_loading`` builds
``FlashInferMoeEp`` of ``fused_moe/flashinfer_moe_ep.py``, which imports ``flashinfer.moe_ep``
inside a method and runs ``MoEEpMegaLayer`` with ``MegaConfig(quantize_input=True)``; ``apply``
hands it the BF16 tokens and copies back an output already reduced over the top-k slots.

The CPU tests load stand-ins written to that contract (read, not copied) under other module
names, registered through moewire's own entry (module names replaced). The ``vllm`` test
reads the released 0.34.0 files that ``make test-vllm`` fetches.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from pathlib import Path

import _main_gptoss
import pytest
import torch
from torch import nn

import moewire
from moewire.integrations._host import SourceReach
from moewire.integrations.vllm import sites as vllm_sites
from moewire.integrations.vllm.quantize import _refuse_sites
from moewire.megamoe import registry
from moewire.megamoe.registry import adapter_for, register_experts_class

MODULE = "vllm.model_executor.layers.fused_moe.experts.flashinfer_moe_ep"
ACCESS = "vllm.model_executor.layers.fused_moe.flashinfer_moe_ep"
H, E, K, T = 64, 8, 2, 6

_ADAPTER = '''
import torch


class FlashInferMoeEp:
    """fused_moe/flashinfer_moe_ep.py: the megakernel, FlashInfer imported on construction."""

    def __init__(self, moe, weights, epilogue=None, *, apply_topk_in_fc1):
        from flashinfer.moe_ep import MegaConfig, MoEEpMegaLayer, MoEEpTensors

        self._tensors = MoEEpTensors
        self._layer = MoEEpMegaLayer(moe, weights, MegaConfig(quantize_input=True))

    def __call__(self, hidden_states, topk_ids, topk_weights):
        return self._layer(self._tensors(hidden_states=hidden_states, topk_ids=topk_ids,
                                         topk_weights=topk_weights))
'''

_EXPERTS = '''
from {adapter} import FlashInferMoeEp


class FlashInferMoeEpExperts:
    """experts/flashinfer_moe_ep.py: the modular experts (no nn.Module)."""

    def __init__(self, moe_config=None, quant_config=None):
        self.moe_config = moe_config
        self._adapter = None

    def process_weights_after_loading(self, layer):
        self._adapter = FlashInferMoeEp(self.moe_config, (layer.w13_weight, layer.w2_weight),
                                        apply_topk_in_fc1=False)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs):
        if self._adapter is None:
            raise RuntimeError("FlashInfer MoE-EP weights have not been processed")
        output.copy_(self._adapter(hidden_states, topk_ids.int(), topk_weights))
'''


class MoELayer(nn.Module):
    """vLLM's MoE layer, reduced to what holds the modular experts and calls ``apply``; the
    experts' megakernel is a stub that sums the top-k weighted tokens (FlashInfer is not
    installed here)."""

    def __init__(self, experts) -> None:
        super().__init__()
        self.register_buffer("w13_weight", torch.zeros(E, 2, H))
        self.register_buffer("w2_weight", torch.zeros(E, H, 1))
        self.quant_method = types.SimpleNamespace(
            moe_kernel=types.SimpleNamespace(fused_experts=experts))

    def forward(self, hidden_states, topk_weights, topk_ids):
        output = torch.empty_like(hidden_states)
        self.quant_method.moe_kernel.fused_experts.apply(
            output, hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return output


def _stub_megakernel(hidden_states, topk_ids, topk_weights):
    return (hidden_states.float() * topk_weights.sum(-1, keepdim=True)).bfloat16()


@pytest.fixture()
def standin(tmp_path, monkeypatch):
    """The two stand-in modules, and the entry pointed at them."""
    def load(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
        module = __import__(name)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))
    adapter = load("fi_ep_adapter", _ADAPTER)
    experts = load("fi_ep_experts", _EXPERTS.format(adapter=adapter.__name__))
    site = dataclasses.replace(_entry(), module=experts.__name__,
                               access_modules=(adapter.__name__,),
                               holder_class=f"{__name__}:MoELayer")
    return experts, site


def _entry() -> vllm_sites.ExpertsSite:
    return next(s for s in vllm_sites.SITES if s.module == MODULE)


def _layer(experts_module) -> MoELayer:
    experts = experts_module.FlashInferMoeEpExperts()
    experts._adapter = _stub_megakernel
    return MoELayer(experts)


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    return x, w, ids


def test_the_entry_is_a_refused_holder_site_reaching_flashinfer():
    site = _entry()
    assert site.cls_name == "FlashInferMoeEpExperts"
    assert site.refusal == vllm_sites.FLASHINFER_EP_EXPERTS_REFUSAL
    assert site.kernel_access == vllm_sites.FLASHINFER_ACCESS
    assert site.access_modules == (ACCESS,)
    assert site.holder == "quant_method.moe_kernel.fused_experts"
    assert site.holder_class == (
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts")


def test_recognised_through_the_module_that_imports_flashinfer(standin):
    """The experts module never names FlashInfer: its adapter module imports
    ``flashinfer.moe_ep`` inside a method. Recognised with the adapter module as an access
    module, not without it; gpt-oss's entry (inline DeepGEMM cast) does not take it.
    Break: read the access only in the experts module's own source."""
    experts, site = standin
    cls = experts.FlashInferMoeEpExperts
    assert vllm_sites.recognise(cls, site) is None
    assert vllm_sites.recognise(cls, dataclasses.replace(site, access_modules=())) == (
        f"{experts.__name__} does not reach DeepGEMM through flashinfer.moe_ep")
    assert vllm_sites.recognise(cls, dataclasses.replace(site, calls=("MoEEpMegaLayer(",))) == (
        f"{experts.__name__} never calls MoEEpMegaLayer(...)")
    gptoss = next(s for s in vllm_sites.SITES if s.cls_name == "DeepGemmMegaExperts")
    assert vllm_sites.recognise(cls, dataclasses.replace(gptoss, module=experts.__name__)) == (
        f"{experts.__name__} never calls per_token_cast_to_fp8(...)")


def test_a_quantized_forward_of_the_holding_layer_is_refused(standin):
    """Registered through the entry on the layer that holds the experts (gpt-oss's stand-in
    plays the bridge): a quantized forward is refused before the megakernel runs, naming the
    switch; a layer holding another experts object is not this site's."""
    experts, site = standin
    cls = experts.FlashInferMoeEpExperts
    register_experts_class(MoELayer, vllm_sites.site_adapter(
        site, cls, forward_module=_main_gptoss.__name__, stage_globals=(),
        flavour=lambda m: "vllm-0.33", ep_group=lambda m: None,
        runtime=lambda: "a vLLM 0.34 stand-in"))
    layer = _layer(experts)
    assert adapter_for(layer).refusal == vllm_sites.FLASHINFER_EP_EXPERTS_REFUSAL
    assert adapter_for(MoELayer(object())) is None
    x, w, ids = _batch()
    assert torch.equal(layer(x, w, ids), _stub_megakernel(x, ids, w))
    moewire.quantize(layer, {"quant_cfg": [{"quantizer_name": "*dispatch_quantizer",
                                            "cfg": {"format": "fp8", "constant_amax": 4.0}}]})
    with pytest.raises(RuntimeError, match=r"FlashInferMoeEpExperts \(--moe-backend "
                       r"flashinfer_moe_ep_cutedsl.*Serve with --moe-backend "
                       r"deep_gemm_mega_moe") as err:
        layer(x, w, ids)
    assert "no per-(token, slot) combine rows" in str(err.value)
    assert "quantize_input=True" in str(err.value)


def test_a_model_holding_the_experts_is_refused_before_conversion(standin):
    """vLLM's quantize step refuses the model at the layer holding the experts object (the
    experts object is no module of the model). Break: match only modules that are instances
    of the experts class."""
    experts, site = standin
    cls = experts.FlashInferMoeEpExperts
    model = nn.ModuleDict({"moe": _layer(experts)})
    with pytest.raises(RuntimeError, match=f"moewire: moe is a {MODULE}.FlashInferMoeEpExperts, "
                       "which moewire does not quantize: it runs FlashInfer's moe_ep"):
        _refuse_sites(model, [(cls, dataclasses.replace(site, module=MODULE))])
    _refuse_sites(nn.ModuleDict({"moe": MoELayer(object())}), [(cls, site)])


@pytest.mark.vllm
def test_the_released_034_files_have_the_structure_of_the_entry():
    """vLLM 0.34.0's released files (fetched by ``make test-vllm``): the experts module
    builds ``FlashInferMoeEp`` (the entry's call), the adapter module imports
    ``flashinfer.moe_ep`` with ``from ... import`` (the entry's access), stages with
    ``quantize_input=True`` and keeps the BF16 combine, and the holder class is the
    installed ``RoutedExperts``."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    src = Path(os.environ.get("MOEWIRE_VLLM_SRC_DIR", ".venv-vllm")) / "vllm-0.34.0-src"
    experts_file, adapter_file = src / "experts" / "flashinfer_moe_ep.py", src / (
        "flashinfer_moe_ep.py")
    if not experts_file.is_file():
        pytest.fail(f"vLLM 0.34.0 sources missing in {src}: run `make test-vllm`")
    site = _entry()
    experts_reach = SourceReach(experts_file.read_text())
    adapter_source = adapter_file.read_text()
    assert all(experts_reach.calls(call) for call in site.calls)
    assert not experts_reach.imports_module(vllm_sites.FLASHINFER_ACCESS, from_imports=True)
    assert experts_reach.imports_module(ACCESS, from_imports=True)
    assert SourceReach(adapter_source).imports_module(vllm_sites.FLASHINFER_ACCESS,
                                                      from_imports=True)
    assert "quantize_input=True" in adapter_source
    assert 'combine_dtype="bf16"' in adapter_source
    assert vllm_sites.holder_class(site) is RoutedExperts
