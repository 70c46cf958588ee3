"""Recipes of ``moewire eval``: a pair's ModelOpt entries, the mixed recipe and what a recipe
costs on the wire.

The mixed recipe puts a low-precision pair on the layers that tolerate it and a safer pair
(the verdict's, or BF16) elsewhere. It is chosen in two steps:

1. :func:`choose_layers`, greedy from the per-layer sensitivities: from the least sensitive
   layer up while ``KL(elsewhere pair on every layer) + sum of the chosen layers' KLs`` stays
   within the budget (the safer pair spends its part of the budget too);
2. :func:`fit_mixed`: KLs of layers do not add exactly (an early layer's error reaches
   every later one), so the candidate is *measured* as a run of its own, and while its
   measured KL is above the budget the most sensitive chosen layer goes back to the safer
   pair, one layer at a time. Only a measured candidate is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Attempt", "WireCost", "choose_layers", "fit_mixed", "mixed_recipe_yaml",
           "pair_entries", "recipe_formats", "wire_cost"]


def _entry(pattern: str, fmt: str) -> dict[str, Any]:
    from moewire import formats

    wire = formats.get(fmt)
    if wire.modelopt_spelling is None:
        cfg: dict[str, Any] = {"format": fmt}
    else:
        cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in wire.modelopt_cfg().items()}
        if isinstance(cfg.get("block_sizes"), dict):
            cfg["block_sizes"] = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg["block_sizes"].items()
            }
    return {"quantizer_name": pattern, "cfg": cfg}


def pair_entries(dispatch: str, combine: str, layers: Sequence[int] | None = None) -> list[dict]:
    """ModelOpt ``quant_cfg`` entries for a pair, on every layer or only on ``layers``.

    A layer's pattern is ``*layers.N.*experts.<quantizer>``: it matches transformers'
    ``model.layers.N.mlp.experts``, vLLM's ``...ffn.experts``/``...block_sparse_moe.experts``
    and SGLang's names alike, and never layer ``N0``..``N9``.
    """
    scopes = ["*"] if layers is None else [f"*layers.{n}.*experts." for n in layers]
    return [
        _entry(f"{scope}{kind}_quantizer", fmt)
        for scope in scopes
        for kind, fmt in (("dispatch", dispatch), ("combine", combine))
    ]


def mixed_entries(low: tuple[str, str], layers: Sequence[int],
                  high: tuple[str, str]) -> list[dict]:
    """``high`` on every layer, then ``low`` on ``layers`` (later entries win)."""
    return pair_entries(*high) + (pair_entries(*low, layers) if layers else [])


def mixed_recipe_yaml(low: tuple[str, str], layers: Sequence[int], high: tuple[str, str],
                      description: str) -> str:
    """A recipe YAML: ``high`` on every layer, then ``low`` (the 4-bit pair) on ``layers``
    (later entries win, as in ModelOpt)."""
    import yaml

    return yaml.safe_dump({"description": description,
                           "quant_cfg": mixed_entries(low, layers, high)}, sort_keys=False,
                          default_flow_style=None, width=100)


def recipe_formats(recipe: Any, module_names: Sequence[str]) -> list[tuple[str, str]]:
    """The ``(dispatch, combine)`` formats a recipe gives each experts module (``bf16`` for
    a quantizer it leaves disabled).

    Args:
        recipe: a recipe name or path, or ``{"quant_cfg": [...]}``.
        module_names: the experts modules' names (``model.layers.3.mlp.experts``).
    """
    from moewire import recipes
    from moewire.quantizer.config import parse_cfg

    if isinstance(recipe, dict):
        loaded = recipes.Recipe.from_entries(recipe["quant_cfg"], modelopt=True)
    else:
        loaded = recipes.load(recipe)

    def fmt(name: str, kind: str) -> str:
        cfg = loaded.match(f"{name}.{kind}_quantizer")
        spec = None if cfg is None else parse_cfg(cfg)
        return spec.fmt if spec is not None and spec.enable else "bf16"

    return [(fmt(n, "dispatch"), fmt(n, "combine")) for n in module_names]


@dataclass(frozen=True)
class WireCost:
    """What a run's formats cost on the wire, averaged over its experts layers.

    Attributes:
        dispatch, combine: the format of every layer, or ``"mixed"``.
        bytes_per_token: dispatch + combine bytes of one routed token.
        wire_us: one layer's dispatch + combine time (the study's time model).
    """

    dispatch: str
    combine: str
    bytes_per_token: float
    wire_us: float


def wire_cost(per_layer: Sequence[tuple[str, str]], hidden: int,
              time_of: Callable[[str, str], float]) -> WireCost:
    """The mean over the layers of each layer's bytes (``WireFormat.wire_bits``) and time.

    Args:
        per_layer: ``(dispatch, combine)`` of each experts layer.
        hidden: the hidden size.
        time_of: ``time_of(dispatch, combine)``: one layer's wire time in us.
    """
    from moewire.study.wire import format_bits

    n = len(per_layer)
    nbytes = sum(format_bits(d, hidden) + format_bits(c, hidden) for d, c in per_layer) / 8 / n
    us = sum(time_of(d, c) for d, c in per_layer) / n
    dispatch = {d for d, _ in per_layer}
    combine = {c for _, c in per_layer}
    return WireCost(dispatch.pop() if len(dispatch) == 1 else "mixed",
                    combine.pop() if len(combine) == 1 else "mixed", nbytes, us)


def choose_layers(sensitivity: dict[int, float], budget: float, spent: float = 0.0) -> list[int]:
    """The layers that take the low-precision pair: from the least sensitive up (ties by
    layer index), while ``spent`` plus their KLs stays within ``budget``; sorted.

    Args:
        sensitivity: layer index -> mean KL with only that layer quantized.
        budget: the mean-KL budget.
        spent: the KL the rest of the model spends already (the safer pair on every
            layer; 0 for BF16).
    """
    chosen, total = [], spent
    for n in sorted(sensitivity, key=lambda layer: (sensitivity[layer], layer)):
        if total + sensitivity[n] > budget:
            break
        chosen.append(n)
        total += sensitivity[n]
    return sorted(chosen)


@dataclass(frozen=True)
class Attempt:
    """One measured candidate of the mixed recipe.

    Attributes:
        layers: the layers on the low-precision pair.
        estimate: the safer pair's KL plus the chosen layers' KLs.
        measured: the candidate's measured mean KL.
    """

    layers: tuple[int, ...]
    estimate: float
    measured: float


def fit_mixed(sensitivity: dict[int, float], budget: float, spent: float,
              measure: Callable[[list[int]], float]) -> tuple[list[int], list[Attempt]]:
    """The mixed recipe's layers: :func:`choose_layers`, then measured and backed off.

    Args:
        sensitivity: layer index -> mean KL with only that layer quantized.
        budget: the mean-KL budget.
        spent: the safer pair's KL on every layer.
        measure: ``measure(layers)``: the measured mean KL of the candidate.

    Returns:
        ``(layers, attempts)``: the layers of the first candidate measured within the
        budget (``[]`` when none is: the safer pair everywhere), and every measurement.
    """
    chosen = choose_layers(sensitivity, budget, spent)
    attempts = []
    while chosen:
        kl = measure(chosen)
        attempts.append(Attempt(tuple(chosen), spent + sum(sensitivity[n] for n in chosen), kl))
        if kl <= budget:
            return chosen, attempts
        # The most sensitive chosen layer goes back first (ties: the higher index).
        chosen.remove(max(chosen, key=lambda layer: (sensitivity[layer], layer)))
    return [], attempts
