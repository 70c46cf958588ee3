"""Fixtures of the SGLang tests: SGLang's released modules and the stand-in DeepGEMM, loaded
for one test and removed after it, with every moewire patch and registration undone."""

from __future__ import annotations

import sys

import _released
import _standin
import pytest

from moewire import patches
from moewire.megamoe import layout_check, registry


@pytest.fixture
def sglang_sm90(monkeypatch):
    """SGLang's released ``mega_moe_sm90`` module (``_device_sm`` 90) on the stand-in."""
    root = _released.wheel_root()
    if root is None:
        pytest.skip("the sglang 0.5.23 wheel is not installed (make test-sglang)")
    saved = {name: sys.modules.get(name) for name in list(sys.modules)
             if name == "sglang" or name.startswith("sglang.") or name == "deep_gemm"}
    before = dict(registry._ADAPTERS)
    monkeypatch.setitem(sys.modules, "deep_gemm", _standin.module())
    added = _released.load(root, device_sm=90)
    layout_check.reset_layout_checks()
    try:
        yield sys.modules[_released.MEGA_MOE_SM90]
    finally:
        patches.undo_all()
        registry._ADAPTERS.clear()
        registry._ADAPTERS.update(before)
        for name in added:
            sys.modules.pop(name, None)
        for name, module in saved.items():
            if module is not None:
                sys.modules[name] = module
        layout_check.reset_layout_checks()
