"""The SGLang Mega-MoE paths with no site entry, refused at load, on CPU without SGLang.

A layer carries the marks SGLang 0.5.23's own weight preparation sets on it
(``moewire.integrations.sglang.paths`` cites where); ``quantize_sglang_model`` refuses it
before looking for DeepGEMM experts. The SGLang tier runs the released modules' own
preparation (``test_sgl_other_paths.py``).
"""

from __future__ import annotations

import sys
import types

import pytest
from torch import nn

from moewire.integrations import sglang as sg
from moewire.integrations.sglang import paths
from moewire.integrations.sglang.sites import MEGA_MOE

NAME = "model.layers.3.mlp.experts"


def _model(**marks) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module() for _ in range(4)])
    model.model.layers[3].mlp = nn.Module()
    experts = nn.Module()
    experts.__dict__.update(marks)
    model.model.layers[3].mlp.experts = experts
    return model


@pytest.mark.parametrize("marks, path", [
    ({"_flashinfer_megamoe_layer": None}, "flashinfer-megamoe"),
    ({"_mega_moe_weights_built": True, "_mega_w1": object()}, "flydsl-megamoe"),
    ({"_megamoe_metadata_prepared": True}, "muse-spark-megamoe"),
    ({"_megamoe_weights_built": True}, "muse-spark-megamoe"),
], ids=["flashinfer", "flydsl", "muse-spark-metadata", "muse-spark-bound"])
def test_layer_on_another_path_refused_at_load(marks, path):
    with pytest.raises(RuntimeError, match=rf"^{NAME}: this layer runs SGLang's {path} path "
                       r"\(sglang\.srt\.layers\.[a-z_.]+\), which moewire has no site for: "
                       r".+; .*unset MOEWIRE_RECIPE$"):
        sg.quantize_sglang_model(_model(**marks), "moe_combine_mxfp8")


def test_flydsl_told_by_sglangs_selection(monkeypatch):
    """FlyDSL's layers carry the DeepGEMM path's ``_mega_moe_weights_built``; without FlyDSL's
    own weights on the layer, SGLang's selection (``_use_amd_flydsl_mega_moe``) decides."""
    mega_moe = types.ModuleType(MEGA_MOE)
    mega_moe._use_amd_flydsl_mega_moe = lambda: True
    monkeypatch.setitem(sys.modules, MEGA_MOE, mega_moe)
    model = _model(_mega_moe_weights_built=True)
    with pytest.raises(RuntimeError, match=rf"^{NAME}: this layer runs SGLang's flydsl-megamoe"):
        sg.quantize_sglang_model(model, "moe_combine_mxfp8")
    mega_moe._use_amd_flydsl_mega_moe = lambda: False
    assert paths.runs_other_path(model.model.layers[3].mlp.experts) is None


def test_unread_path_refused_at_load():
    with pytest.raises(RuntimeError, match=(
            rf"^{NAME}: this layer carries _kimi_megamoe_prepared, the mark of an SGLang "
            "Mega-MoE path moewire has not read")):
        sg.quantize_sglang_model(_model(_kimi_megamoe_prepared=True), "moe_combine_mxfp8")


def test_flags_are_no_marks():
    """A model's flags (``_use_mega_moe``) and ``FusedMoE``'s own ``False`` marks refuse
    nothing: the model has no Mega-MoE experts, and says so."""
    model = _model(_use_mega_moe=True, use_megamoe=True, _mega_moe_weights_built=False,
                   _megamoe_weights_built=False)
    with pytest.raises(RuntimeError, match="has no Mega-MoE experts"):
        sg.quantize_sglang_model(model, "moe_combine_mxfp8")


def test_engine_combines_named_by_their_formats(monkeypatch):
    """Where the engine quantizes its own combine, the refusal names moewire's format of
    that cast, and the format exists."""
    from moewire import formats

    monkeypatch.setenv(paths.ENV_FLASHINFER_COMBINE, "mxfp8")
    for marks, fmt in (({"_flashinfer_megamoe_layer": None}, "flashinfer_mxfp8"),
                       ({"_mega_moe_weights_built": True, "_mega_w1": 1}, paths.FLYDSL_COMBINE)):
        assert formats.get(fmt).name == fmt
        with pytest.raises(RuntimeError, match=f"moewire's {fmt} format is that cast"):
            sg.quantize_sglang_model(_model(**marks), "moe_combine_mxfp8")
