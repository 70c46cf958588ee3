"""``moewire eval``: perplexity, KL, top-1 agreement, per-layer error and (through
lm-evaluation-harness) task accuracy of wire format pairs on a local transformers MoE
checkpoint (:func:`evaluate`).

The package: ``settings`` (:class:`EvalConfig`, what to measure), ``checks`` (every check
before the model loads), ``plan`` (the checks that need the text or the device, the tokens
and their windows), ``metrics`` (the streaming sums, on the device), ``recipe`` (a pair's
entries, the mixed recipe, wire cost), ``session`` (the model converted once, each run's
quantizers swapped in), ``runner`` (the lockstep runs, the verdict), ``tasks`` (lm-eval),
``report`` (the table and the plot).
"""

from moewire.eval.checks import EvalError, parse_pair
from moewire.eval.recipe import choose_layers, mixed_recipe_yaml, pair_entries
from moewire.eval.report import table
from moewire.eval.runner import PairResult, evaluate
from moewire.eval.settings import EvalConfig

__all__ = ["EvalConfig", "EvalError", "PairResult", "choose_layers", "evaluate",
           "mixed_recipe_yaml", "pair_entries", "parse_pair", "table"]
