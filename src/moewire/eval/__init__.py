"""``moewire eval``: perplexity, KL, top-1 agreement, per-layer error and (through
lm-evaluation-harness) task accuracy of wire format pairs on a local transformers MoE
checkpoint (:func:`evaluate`).

The package: ``checks`` (every check before the model loads), ``metrics`` (the streaming
sums, on the device), ``recipe`` (a pair's entries, the mixed recipe, wire cost),
``runner`` (the lockstep runs), ``tasks`` (lm-eval), ``report`` (the table and the plot).
"""

from moewire.eval.checks import EvalError, parse_pair
from moewire.eval.recipe import choose_layers, mixed_recipe_yaml, pair_entries
from moewire.eval.report import table
from moewire.eval.runner import PairResult, evaluate

__all__ = ["EvalError", "PairResult", "choose_layers", "evaluate", "mixed_recipe_yaml",
           "pair_entries", "parse_pair", "table"]
