"""Where the combine rows are and in what order they add up; the experts wrapper.

- ``flavours``: one flavour per DeepGEMM build (``deepgemm-main``, ``vllm-0.32``,
  ``vllm-0.33``, ``deepgemm-sm90``), each kernel function's combine layout, a registry.
- ``combine_rows(symm_buffer, flavour, kernel)``: the BF16 ``[num_slots, Tmax, H]`` view.
- ``resum(rows, topk_idx, num_tokens, ...)``: the kernel's combine sum, with fake-quantized
  rows.
- ``ExpertsAdapter`` / ``register_experts_class`` / ``adapter_for``: how an experts class
  is hooked.
- ``convert`` (the in-place ModelOpt-style class swap), ``QuantExperts`` (its mixin, for
  other class-swap frameworks) with ``install_proxies``, ``layout_checked`` and
  ``unproven_readings`` (the shared-row readings the layout check has not yet ruled out).
- ``quantize``, ``unquantize``, ``calibrate``, ``save_scales``, ``load_scales``, ``summary``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Eager, and bound after the import: importing the submodule ``moewire.megamoe.resum`` sets
# the package attribute ``resum`` to the submodule; this rebinding makes
# ``from moewire.megamoe import resum`` the function in every import order.
from moewire.megamoe.resum import resum as resum

_LAZY = {
    "Flavour": ("moewire.megamoe.flavours", "Flavour"),
    "combine_rows": ("moewire.megamoe.layout", "combine_rows"),
    "KernelLayout": ("moewire.megamoe.flavours", "KernelLayout"),
    "ExpertsAdapter": ("moewire.megamoe.registry", "ExpertsAdapter"),
    "register_experts_class": ("moewire.megamoe.registry", "register_experts_class"),
    "adapter_for": ("moewire.megamoe.registry", "adapter_for"),
    "convert": ("moewire.megamoe.convert", "convert"),
    "is_converted": ("moewire.megamoe.convert", "is_converted"),
    "install_proxies": ("moewire.megamoe.hooks", "install_proxies"),
    "layout_checked": ("moewire.megamoe.layout_check", "layout_checked"),
    "unproven_readings": ("moewire.megamoe.layout_check", "unproven_readings"),
    "QuantExperts": ("moewire.megamoe.quant_experts", "QuantExperts"),
    "quantize": ("moewire.megamoe.api", "quantize"),
    "calibrate": ("moewire.megamoe.api", "calibrate"),
    "save_scales": ("moewire.megamoe.api", "save_scales"),
    "load_scales": ("moewire.megamoe.api", "load_scales"),
    "summary": ("moewire.megamoe.api", "summary"),
    "unquantize": ("moewire.megamoe.api", "unquantize"),
}

__all__ = sorted([*_LAZY, "resum", "flavours"])


def __getattr__(name: str) -> Any:
    # Lazy: integrations import the registry alone, without the quantizer stack.
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name == "flavours":
        return importlib.import_module("moewire.megamoe.flavours")
    raise AttributeError(f"module 'moewire.megamoe' has no attribute {name!r}")
