"""``moewire.megamoe.wrapper`` keeps the names it had before the split: code that
imports them, and a model pickled before the split (its pickle names
``moewire.megamoe.wrapper._rebuild_quant``), keep working."""

from __future__ import annotations

import io
import pickle

import torch

import moewire
from moewire.megamoe import convert as convert_module
from moewire.megamoe import wrapper


def test_the_old_names_are_the_new_objects():
    assert wrapper.convert is convert_module.convert
    assert wrapper._rebuild_quant is convert_module._rebuild_quant
    for name in wrapper.__all__:
        assert getattr(wrapper, name) is not None


def test_a_pickle_naming_the_old_module_loads(monkeypatch):
    """Pickle a converted module as the old code did (its reduce named
    ``moewire.megamoe.wrapper._rebuild_quant``) and load it: the converted class comes back."""
    from moewire.reference import MegaMoEExperts

    model = torch.nn.Sequential(MegaMoEExperts(num_experts=16, top_k=4, hidden=512,
                                               intermediate=512, max_num_tokens=64, seed=0))
    moewire.quantize(model, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer",
         "cfg": {"format": "fp8", "constant_amax": 4.0}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"enable": False}},
    ]})
    quant = model[0]
    real_reduce = type(quant).__reduce_ex__

    def old_reduce(self, protocol):
        fn, args, state = real_reduce(self, protocol)
        assert fn is convert_module._rebuild_quant
        return wrapper._rebuild_quant, args, state

    monkeypatch.setattr(convert_module._rebuild_quant, "__module__", "moewire.megamoe.wrapper")
    monkeypatch.setattr(type(quant), "__reduce_ex__", old_reduce)
    data = io.BytesIO()
    pickle.dump(quant, data)
    assert b"moewire.megamoe.wrapper" in data.getvalue()
    loaded = pickle.loads(data.getvalue())
    assert type(loaded).__name__ == type(quant).__name__
    assert moewire.megamoe.is_converted(loaded)
