"""``EvalConfig``: what ``evaluate`` builds from keywords, what it refuses beside a config, and
the verdict's rule (the study's ``cheapest_within``) giving eval's answer: the fewest bytes
within the mean-KL budget, then the lower KL, the baseline never a candidate."""

from __future__ import annotations

import random
import types

import pytest

from moewire.eval import EvalConfig, evaluate
from moewire.eval.runner import _cheapest
from moewire.eval.settings import DEFAULT_PAIRS, config_from
from moewire.study.verdict import Budget


def test_keywords_build_the_config_a_config_is_used_as_given():
    assert config_from(None, {}) == EvalConfig()
    assert EvalConfig().pairs == DEFAULT_PAIRS
    pairs = [("fp8", "nvfp4")]
    built = config_from(pairs, {"budget": 1e-3, "seq_len": 32})
    assert built == EvalConfig(pairs=pairs, budget=1e-3, seq_len=32)
    assert config_from(None, {"pairs": pairs}) == EvalConfig(pairs=pairs)
    assert config_from(built, {}) is built


@pytest.mark.parametrize(("config", "fields", "message"), [
    (EvalConfig(), {"budget": 1e-3, "text": "x"},
     r"got an EvalConfig and the keyword arguments budget, text; pass one of them: "
     r"dataclasses.replace\(config, budget=...\)"),
    ([("fp8", "fp8")], {"pairs": [("fp8", "nvfp4")]}, "got the pairs twice"),
    (None, {"ep_size": 2}, "unknown keyword argument\\(s\\) ep_size; EvalConfig's fields are"),
    (EvalConfig(), {"ep_size": 2}, "unknown keyword argument"),
], ids=["config-and-keywords", "pairs-twice", "unknown-keyword", "unknown-beside-a-config"])
def test_refused_before_anything_is_read(config, fields, message):
    with pytest.raises(TypeError, match=message):
        evaluate("/nonexistent", config, log=lambda s: None, **fields)


def _run(name: str, bytes_per_token: float, kl_mean: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, bytes_per_token=bytes_per_token, kl_mean=kl_mean)


@pytest.mark.parametrize("seed", range(20))
def test_the_shared_rule_gives_the_fewest_bytes_then_the_lower_kl(seed):
    """Against the plain statement of eval's verdict, on random runs with repeated bytes and
    KLs on the budget: the shared rule with no cost tolerance is exactly it."""
    rng = random.Random(seed)
    runs = [_run(f"r{i}", rng.choice([528.0, 544.0, 1056.0, 288.0]),
                 rng.choice([0.0, 1e-3, 2e-3, 4e-3, 8e-3])) for i in range(rng.randint(0, 8))]
    budget = rng.choice([0.0, 1e-3, 4e-3, 1.0])
    within = [r for r in runs if r.kl_mean <= budget]
    want = min(within, key=lambda r: (r.bytes_per_token, r.kl_mean), default=None)
    assert _cheapest(runs, budget) is want


def test_a_budget_names_the_metric_it_bounds():
    assert Budget("kl_mean", 1e-3).describe() == "KL mean <= 0.001"
    assert Budget("kl_mean", 1e-3).admits({"kl_mean": 1e-3})
    assert not Budget("kl_mean", 1e-3).admits(_run("x", 1.0, 2e-3))
    with pytest.raises(ValueError, match="kind 'kl' is not one of rel_l2, sqnr_db, kl_mean"):
        Budget("kl", 1e-3)
