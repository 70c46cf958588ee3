"""The experts adapter registry."""

from __future__ import annotations

import pytest
from torch import nn

from moewire.megamoe.registry import (
    ExpertsAdapter,
    adapter_for,
    register_experts_class,
    registered_classes,
)
from moewire.reference import MegaMoEExperts


def adapter(name: str) -> ExpertsAdapter:
    return ExpertsAdapter(
        name=name,
        forward_module="moewire.reference.experts",
        stage_fn="stage_mega_moe_inputs",
        stage_hidden_arg=0,
        kernel_ns="deep_gemm",
        get_symm_buffer=lambda m: m.get_symm_buffer(),
        flavour=lambda m: "vllm-0.33",
        fused_shared=lambda m: m.fused_shared,
        ep_group=lambda m: None,
    )


def test_reference_is_registered():
    a = registered_classes()[MegaMoEExperts]
    assert a.name == "reference"
    assert (a.forward_module, a.stage_fn, a.kernel_ns) == (
        "moewire.reference.experts",
        "stage_mega_moe_inputs",
        "deep_gemm",
    )


def test_subclasses_inherit_until_registered(registries_restored):
    class Child(MegaMoEExperts):
        pass

    class GrandChild(Child):
        pass

    m = object.__new__(GrandChild)
    assert adapter_for(m).name == "reference"
    register_experts_class(Child, adapter("child"))
    assert adapter_for(m).name == "child"
    assert adapter_for(nn.Linear(2, 2)) is None


@pytest.mark.parametrize(
    "cls,adp,match",
    [
        (int, adapter("x"), "nn.Module subclass"),
        (nn.Linear, {"name": "x"}, "ExpertsAdapter"),
    ],
    ids=["not-a-module", "not-an-adapter"],
)
def test_register_refusals(cls, adp, match):
    with pytest.raises(TypeError, match=match):
        register_experts_class(cls, adp)
