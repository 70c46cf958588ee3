"""register() next to a ModelOpt that registers the same experts class itself."""

from __future__ import annotations

import pytest

pytest.importorskip("modelopt.torch.quantization")

from modelopt.torch.quantization.nn import QuantModule, QuantModuleRegistry  # noqa: E402

import moewire.integrations.modelopt as mw_mo  # noqa: E402
from moewire.megamoe.registry import adapter_for, register_experts_class  # noqa: E402
from moewire.reference import MegaMoEExperts  # noqa: E402


class _ModelOptsOwn(MegaMoEExperts):
    """A Mega-MoE experts class that ModelOpt (as in its PR #2767) registers itself."""


class _ModelOptsQuant(QuantModule):
    def _setup(self) -> None:
        pass


def test_a_class_modelopt_registers_itself_is_refused_with_what_to_do(registries_restored):
    register_experts_class(_ModelOptsOwn, adapter_for(object.__new__(MegaMoEExperts)))
    QuantModuleRegistry.register({_ModelOptsOwn: "modelopt.MegaMoEExperts"})(_ModelOptsQuant)
    try:
        with pytest.raises(RuntimeError, match=r"ModelOpt already registers .*_ModelOptsOwn "
                           r"\(key 'modelopt.MegaMoEExperts'\).*QuantModuleRegistry.unregister"):
            mw_mo.register(vllm=False)
        assert _ModelOptsOwn not in mw_mo.registered_classes()
    finally:
        QuantModuleRegistry.unregister(_ModelOptsOwn)
    assert _ModelOptsOwn in mw_mo.register(vllm=False)  # once ModelOpt lets go of it
