"""The stand-in's experts adapters and the real SM90 kernel's sit together in
``moewire.megamoe.deepgemm_experts``; the registry registers them without importing them."""

from __future__ import annotations

import pytest

from import_graph import src_graph
from moewire.megamoe import deepgemm_experts, registry
from moewire.reference.experts import MegaMoEExperts
from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts
from moewire.reference.nvfp4.experts import NVFP4MegaMoEExperts


def test_the_registry_imports_no_experts_class_and_no_adapter_module():
    imported = src_graph()["moewire.megamoe.registry"]
    assert not {m for m in imported if m.startswith(("moewire.reference", "moewire.integrations"))}
    assert deepgemm_experts.__name__ not in imported


@pytest.mark.parametrize("cls, name, stage_fn", [
    (MegaMoEExperts, "reference", "stage_mega_moe_inputs"),
    (NVFP4MegaMoEExperts, "reference-nvfp4", "prepare_megamoe_nvfp4_inputs"),
    (FP4MegaMoEExperts, "reference-fp4-fp4", "prepare_megamoe_nvfp4_inputs"),
], ids=["fp8xfp4-bf16", "nvfp4", "fp4xfp4"])
def test_each_stand_in_class_has_its_adapter_from_the_adapters_module(cls, name, stage_fn):
    adapter = registry.registered_classes()[cls]
    assert (adapter.name, adapter.forward_module, adapter.stage_fn) == (
        name, cls.__module__, stage_fn)


def test_the_sm90_kernel_module_re_exports_its_adapter():
    from moewire.integrations import deepgemm_sm90

    assert deepgemm_sm90.register_sm90_experts is deepgemm_experts.register_sm90_experts
    assert deepgemm_sm90.symm_buffer_of is deepgemm_experts.symm_buffer_of
    adapter = registry.registered_classes()[deepgemm_sm90.SM90MegaMoEExperts]
    assert adapter.forward_module == deepgemm_sm90.__name__
    assert adapter.flavour(None) == deepgemm_sm90.FLAVOUR == "deepgemm-sm90"
