"""The mixed recipe keeps its budget: chosen greedily with the safer pair's KL counted,
measured as a run of its own, backed off layer by layer, written only when within; its
bytes per token are the layers' own."""

from __future__ import annotations

import pytest

from moewire.eval.recipe import Attempt, choose_layers, fit_mixed, wire_cost


@pytest.mark.parametrize(
    ("sensitivity", "budget", "spent", "expected"),
    [
        ({0: 3e-3, 1: 1e-3, 2: 2e-3}, 3e-3, 0.0, [1, 2]),
        ({0: 3e-3, 1: 1e-3, 2: 2e-3}, 3e-3, 1e-3, [1]),       # the safer pair spends 1e-3
        ({0: 3e-3, 1: 1e-3, 2: 2e-3}, 3e-3, 2.5e-3, []),      # nothing left for any layer
    ],
    ids=["bf16-elsewhere", "pair-elsewhere-spends", "pair-elsewhere-spends-all"],
)
def test_choose_layers_counts_what_the_pair_elsewhere_spends(sensitivity, budget, spent,
                                                             expected):
    assert choose_layers(sensitivity, budget, spent) == expected


def test_fit_backs_off_the_most_sensitive_layer_until_the_measurement_fits():
    sensitivity = {0: 4e-3, 1: 1e-3, 2: 2e-3, 3: 5e-4}
    # Errors compound: the measured KL is 1.5x the sum here.
    measured = {}

    def measure(layers):
        measured[tuple(layers)] = 1.5 * sum(sensitivity[n] for n in layers) + 1e-3
        return measured[tuple(layers)]

    layers, attempts = fit_mixed(sensitivity, 5e-3, 1e-3, measure)
    # Greedy: 1e-3 + 5e-4 + 1e-3 + 2e-3 = 4.5e-3 (layers 1, 2, 3); measured 6.25e-3 > 5e-3,
    # so layer 2 (the most sensitive chosen) goes back: 1e-3 + 1.5 * 1.5e-3 = 3.25e-3.
    assert layers == [1, 3]
    assert attempts == [Attempt((1, 2, 3), pytest.approx(4.5e-3), pytest.approx(6.25e-3)),
                        Attempt((1, 3), pytest.approx(2.5e-3), pytest.approx(3.25e-3))]


def test_fit_writes_nothing_when_no_candidate_measures_within():
    layers, attempts = fit_mixed({0: 1e-3, 1: 1e-3}, 3e-3, 0.0, lambda layers: 1.0)
    assert layers == [] and [a.layers for a in attempts] == [(0, 1), (0,)]


def test_wire_cost_weights_each_layers_formats():
    """Bytes per routed token of a recipe: the mean of each layer's dispatch + combine bytes
    (H = 128: bf16 256 bytes a row, fp8 128, nvfp4 72)."""
    cost = wire_cost([("nvfp4", "nvfp4"), ("fp8", "fp8"), ("fp8", "fp8"), ("fp8", "fp8")], 128,
                     lambda d, c: {"fp8": 2.0, "nvfp4": 1.0}[d])
    assert cost.bytes_per_token == (144 + 3 * 256) / 4
    assert cost.wire_us == (1.0 + 3 * 2.0) / 4
    assert (cost.dispatch, cost.combine) == ("mixed", "mixed")
    assert wire_cost([("fp8", "nvfp4")] * 2, 128, lambda d, c: 1.0).dispatch == "fp8"


#: A budget between what the safer pair plus the least sensitive layers spend and what the
#: naive sum (the layers' KLs alone) lets through, on the 3-layer tiny Qwen3-MoE below.
BUDGET = 1.6e-3


def test_the_written_recipe_measures_within_the_budget_where_the_naive_sum_does_not(
        checkpoint, tmp_path):
    """On a tiny model: the layers whose KLs alone sum within the budget (the naive choice,
    ignoring the KL of fp8:fp8 elsewhere) measure above it; the recipe written measures
    within it, and re-measured from its YAML file gives the same KL bit for bit; its bytes
    are the layers' own."""
    pytest.importorskip("transformers.integrations.moe")
    from eval_helpers import TEXT

    from moewire.eval import evaluate, mixed_recipe_yaml

    path = checkpoint("qwen3_moe", layers=3)
    common = dict(text=TEXT, max_tokens=64, seq_len=32, device="cpu", log=lambda s: None)
    report = evaluate(path, [("fp8", "fp8")], per_layer=("nvfp4", "nvfp4"), budget=BUDGET,
                      out_dir=tmp_path / "out", **common)
    assert report["budget"]["verdict"] == "fp8:fp8"
    per_layer = report["per_layer"]
    sensitivity = per_layer["kl_by_layer"]
    naive = choose_layers(sensitivity, BUDGET)
    assert naive and naive != per_layer["layers"]
    (tmp_path / "naive.yaml").write_text(
        mixed_recipe_yaml(("nvfp4", "nvfp4"), naive, ("fp8", "fp8"), "naive"))
    again = evaluate(path, [], recipes=[str(tmp_path / "naive.yaml"), per_layer["recipe"]],
                     **common)
    base, naive_run, written = again["pairs"]
    assert naive_run["kl_mean"] > BUDGET, "the naive sum must overspend for this test to tell"
    assert written["kl_mean"] == per_layer["kl_mean"] <= BUDGET
    mixed = report["pairs"][-1]
    assert mixed["name"].startswith("mixed (nvfp4:nvfp4 on") and mixed["kl_mean"] <= BUDGET
    low = len(per_layer["layers"])
    # H = 128: a routed token's nvfp4 pair is 144 bytes, fp8's 256.
    assert written["bytes_per_token"] == mixed["bytes_per_token"] == (low * 144
                                                                      + (3 - low) * 256) / 3
