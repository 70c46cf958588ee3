"""``moewire eval``: perplexity, KL, top-1 agreement and per-layer error of wire format pairs
on a local transformers MoE checkpoint (:func:`evaluate`)."""

from moewire.eval.runner import (
    EvalError,
    PairResult,
    choose_layers,
    evaluate,
    mixed_recipe_yaml,
    pair_entries,
    parse_pair,
    table,
)

__all__ = ["EvalError", "PairResult", "choose_layers", "evaluate", "mixed_recipe_yaml",
           "pair_entries", "parse_pair", "table"]
