"""Fixtures of the SGLang tests: SGLang's released modules and the stand-in DeepGEMM, loaded
for one test and removed after it, with every moewire patch and registration undone."""

from __future__ import annotations

import contextlib
import sys

import _released
import _sgl_standin
import pytest

from moewire import patches
from moewire.megamoe import layout_check, registry


@contextlib.contextmanager
def _sglang(monkeypatch, device_sm: int, deep_gemm, other: bool = False):
    root = _released.wheel_root()
    if root is None:
        pytest.skip("the sglang 0.5.23 wheel is not installed (make test-sglang)")
    saved = {name: sys.modules.get(name) for name in list(sys.modules)
             if name == "sglang" or name.startswith("sglang.") or name == "deep_gemm"}
    before = dict(registry._ADAPTERS)
    monkeypatch.setitem(sys.modules, "deep_gemm", deep_gemm)
    added = _released.load(root, device_sm=device_sm, other=other)
    layout_check.reset_layout_checks()
    try:
        yield
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


@pytest.fixture
def sglang_sm90(monkeypatch):
    """SGLang's released modules as on a Hopper (``_device_sm`` 90), on the SM90 stand-in;
    yields ``mega_moe_sm90``."""
    with _sglang(monkeypatch, 90, _sgl_standin.module()):
        yield sys.modules[_released.MEGA_MOE_SM90]


@pytest.fixture
def sglang_sm100(monkeypatch):
    """SGLang's released modules as on a Blackwell (``_device_sm`` 100), on the SM100
    stand-in (``_sgl_standin.sm100_module``); yields ``mega_moe``."""
    with _sgl_standin.sm100_module(monkeypatch) as deep_gemm, _sglang(monkeypatch, 100, deep_gemm):
        yield sys.modules[_released.MEGA_MOE]


@pytest.fixture
def sglang_other(monkeypatch):
    """As ``sglang_sm90``, with the wheel's other Mega-MoE modules loaded (FlashInfer, FlyDSL,
    Muse Spark: ``_released.OTHER``) over the libraries' load-time names
    (``_other_standins``); yields ``sys.modules``."""
    import _other_standins

    for name, module in _other_standins.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    with _sglang(monkeypatch, 90, _sgl_standin.module(), other=True):
        yield sys.modules
