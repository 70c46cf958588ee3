"""moewire: simulate FP8/NVFP4 MoE dispatch and combine inside fused Mega-MoE kernels.

Public API (short and stable):

- ``fake_quant(x, name, amax=None)``: one wire format applied to a tensor.
- ``WireQuantizer``: a quantizer module with calibration state (amax, enable, modes).
- ``quantize(model, recipe, forward_loop=None)``: attach and calibrate dispatch/combine
  quantizers on every Mega-MoE experts module of a model.
- ``calibrate(model, forward_loop)``: calibrate a quantized model again (new batches).
- ``unquantize(model)``: undo ``quantize`` (original classes back, every patch undone).
- ``save_scales`` / ``load_scales`` / ``summary``.
- ``formats``, ``recipes``, ``reference`` (the stand-in DeepGEMM Mega-MoE kernel).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "fake_quant": ("moewire.formats", "fake_quant"),
    "WireQuantizer": ("moewire.quantizer", "WireQuantizer"),
    "quantize": ("moewire.megamoe.api", "quantize"),
    "calibrate": ("moewire.megamoe.api", "calibrate"),
    "save_scales": ("moewire.megamoe.api", "save_scales"),
    "load_scales": ("moewire.megamoe.api", "load_scales"),
    "summary": ("moewire.megamoe.api", "summary"),
    "unquantize": ("moewire.megamoe.api", "unquantize"),
}
_SUBMODULES = {"formats", "recipes", "reference", "megamoe", "kernels", "integrations", "study"}

__all__ = sorted(_LAZY) + sorted(_SUBMODULES)


def __getattr__(name: str):
    # Lazy so that `import moewire` stays cheap and the CLI starts fast.
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"moewire.{name}")
    raise AttributeError(f"module 'moewire' has no attribute {name!r}")
