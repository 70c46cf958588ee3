"""The study's fake-quantization timing compares the quantized layer with a fresh
unquantized copy over the same weights, never with itself."""

from __future__ import annotations

import torch

from moewire.megamoe.convert import is_converted
from moewire.study import StudyConfig
from moewire.study import layer as study_layer
from moewire.study.runner import _batches


def test_the_timed_reference_is_an_unquantized_copy_not_the_model(monkeypatch):
    """Break: time the quantized model against itself (``added_forward_us(model, model,
    ...)``): the added time is ~0 whatever the quantization costs."""
    cfg = StudyConfig(model="tiny", tokens=16, calib_batches=1, eval_batches=1)
    generator = torch.Generator().manual_seed(cfg.seed)
    layer = study_layer.build_layer(cfg, generator)
    calib, evals = _batches(cfg, layer, generator)
    seen = {}

    def added(model, reference, batches):
        seen.update(model=model, reference=reference, batches=batches,
                    converted=(is_converted(model.experts), is_converted(reference.experts)),
                    same_weights=torch.equal(model.experts.w13_weight,
                                             reference.experts.w13_weight))
        return 1.5

    monkeypatch.setattr(study_layer, "added_forward_us", added)
    run = study_layer.run_pair(layer, "fp8", "bf16", calib, evals, timed=True)
    assert run.added_us == 1.5
    assert seen["reference"] is not seen["model"]
    assert seen["converted"] == (True, False) and seen["same_weights"]
    assert seen["batches"] is evals
