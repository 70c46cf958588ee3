"""A recipe in ModelOpt's own ``quant_cfg`` spelling (:func:`to_modelopt`, for ``mtq.quantize``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moewire import formats
from moewire.quantizer.config import USE_CONSTANT_AMAX, modelopt_table, parse_cfg
from moewire.recipes.loading import load

__all__ = ["to_modelopt"]

# moewire-only cfg keys: ``format`` is respelled in ModelOpt's attributes; ``allow_dynamic``
# has no ModelOpt counterpart (an uncalibrated ModelOpt quantizer is dynamic).
_MOEWIRE_ONLY_KEYS = ("format", "allow_dynamic")


def _to_modelopt_cfg(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    spec = parse_cfg(cfg)
    out = {k: v for k, v in cfg.items() if k not in _MOEWIRE_ONLY_KEYS and k not in (
        "num_bits", "block_sizes", "axis")}
    if out.pop("use_constant_amax", False):
        # The same amax, in the key ModelOpt's experts quantizers take (ModelOpt keeps
        # use_constant_amax for its KV-cache quantizers).
        out["constant_amax"] = USE_CONSTANT_AMAX
    if not spec.enable and "num_bits" not in cfg and "format" not in cfg:
        return out
    spelled = formats.get(spec.fmt).modelopt_cfg()
    if spelled is None:
        raise ValueError(
            f"to_modelopt: {where} uses format {spec.fmt!r}, which ModelOpt cannot spell "
            "(no num_bits/block_sizes/axis for it); use moewire.quantize for this recipe, or "
            f"pick a format with a ModelOpt spelling ({', '.join(modelopt_table().values())})"
        )
    return {**spelled, **out}


def to_modelopt(name_or_path: str | os.PathLike) -> list[dict[str, Any]]:
    """A recipe as ModelOpt's ``quant_cfg`` list (for ``mtq.quantize``).

    ``units`` are expanded in order; each entry keeps ``quantizer_name`` and ``enable``; its
    ``cfg`` is written in ModelOpt's attribute names only: ``format`` becomes ``num_bits``
    / ``block_sizes`` / ``axis`` (tuples, as ModelOpt writes them), ``allow_dynamic`` is
    dropped, ``constant_amax`` and ``enable`` stay, ``use_constant_amax: true`` becomes
    ``constant_amax: 448.0`` (the same amax; moewire's ModelOpt quantizers take that key). With
    ``moewire.integrations.modelopt.register()`` done, ``mtq.quantize(model, {"quant_cfg":
    [*other_entries, *to_modelopt(name)], "algorithm": "max"}, forward_loop)`` configures
    the experts' ``dispatch_quantizer`` / ``combine_quantizer`` as ``moewire.quantize(model,
    name, forward_loop)`` does.

    Args:
        name_or_path: a packaged recipe name or a recipe file (:func:`load`).

    Returns:
        ``[{"quantizer_name": ..., "cfg": {...}, "enable": ...}, ...]``, fresh dicts.

    Raises:
        ValueError: the recipe does not load (see :func:`load`), or an entry enables a
            format ModelOpt has no spelling for (``logfmt10``, ``fp8_b32_ue8m0``, ``bf16``).
    """
    recipe = load(name_or_path)
    entries = []
    for entry in recipe.entries:
        out: dict[str, Any] = {"quantizer_name": entry.quantizer_name}
        if entry.cfg is not None:
            out["cfg"] = _to_modelopt_cfg(entry.cfg, entry.source)
        if entry.enable is not None:
            out["enable"] = entry.enable
        entries.append(out)
    return entries
