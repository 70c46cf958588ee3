"""The names SGLang's other Mega-MoE paths read of their libraries while a model loads.

SGLang 0.5.23's ``flashinfer_megamoe.py`` prepares a layer's weights with FlashInfer's
``moe_ep`` (``MoEWeightPack`` and the ``preprocess_*_mega_weights`` of its config: FlashInfer
0.7.2.post1, ``moe_ep/__init__.py``); ``mega_moe_flydsl.py`` shuffles them with aiter's A16W4
shuffles and imports ``MegaMoEV2``. Here the preparation hands the weights back unchanged
(the layout is the libraries' business: what these tests check is that moewire refuses a
layer those paths prepared, at load, before any forward); every kernel and layer class
raises, since moewire's refusal comes first.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any


def _absent(what: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{what}: the refusal at load comes before it")

    return call


@dataclass
class MoEWeightPack:
    """``flashinfer.moe_ep.MoEWeightPack``: a layer's expert weights and block scales."""

    w13: Any
    w2: Any
    w13_scale: Any = None
    w2_scale: Any = None


def _unchanged(weights: MoEWeightPack, **kwargs) -> tuple:
    """A ``preprocess_*_mega_weights``: ``((w13, w13_scale), (w2, w2_scale))``."""
    return (weights.w13, weights.w13_scale), (weights.w2, weights.w2_scale)


def modules() -> dict[str, types.ModuleType]:
    """``flashinfer.moe_ep`` and ``aiter``'s modules by name (packages included)."""
    found = {}
    for name in ("flashinfer", "aiter", "aiter.ops", "aiter.ops.flydsl",
                 "aiter.ops.flydsl.kernels"):
        found[name] = types.ModuleType(name)
        found[name].__path__ = []
    moe_ep = types.ModuleType("flashinfer.moe_ep")
    moe_ep.MoEWeightPack = MoEWeightPack
    for fn in ("preprocess_mega_weights", "preprocess_mxfp8_cutedsl_mega_weights",
               "preprocess_nvfp4_cutedsl_mega_weights",
               "preprocess_bf16_nvfp4_cutedsl_mega_weights"):
        setattr(moe_ep, fn, _unchanged)
    for cls in ("MoEEpMegaLayer", "MoEEpTensors", "BootstrapConfig", "FleetParams",
                "MegaConfig", "DeepGemmMegaMoeConfig", "Mxfp8CutedslMegaMoeConfig",
                "Nvfp4CutedslMegaMoeConfig", "Sm100_Bf16_Nvfp4_Bf16_Cutedsl_MegaMoeConfig"):
        setattr(moe_ep, cls, _absent(f"flashinfer.moe_ep.{cls}"))
    found["flashinfer.moe_ep"] = moe_ep
    kernels = types.ModuleType("aiter.ops.flydsl.kernels.mega_moe")
    kernels.MegaMoEV2 = _absent("aiter MegaMoEV2")
    found["aiter.ops.flydsl.kernels.mega_moe"] = kernels
    shuffle = types.ModuleType("aiter.ops.shuffle")
    shuffle.shuffle_weight_a16w4 = lambda weight, *args: weight
    shuffle.shuffle_scale_a16w4 = lambda scale, *args: scale
    found["aiter.ops.shuffle"] = shuffle
    return found
