"""``moewire.recipes.to_modelopt``: a recipe as ModelOpt's quant_cfg, through ``mtq.quantize``."""

import textwrap

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.modelopt
pytest.importorskip("modelopt.torch.quantization")

import modelopt.torch.quantization as mtq  # noqa: E402

import moewire  # noqa: E402
from moewire import formats, recipes  # noqa: E402
from moewire.integrations import modelopt as mw_mo  # noqa: E402
from moewire.megamoe.layout_check import reset_layout_checks  # noqa: E402
from moewire.reference import MegaMoEExperts, forward_context, make_weights  # noqa: E402

E, K, H, INTER, TMAX = 8, 2, 512, 512, 32
WEIGHTS = make_weights(E, H, INTER, experts=range(E), seed=0, device="cpu")
# Presets and units ModelOpt can spell; bit-exact ones are compared output for output.
SPELLED = ["moe_fp8", "moe_nvfp4", "moe_fp8_dispatch_nvfp4_combine",
           "moe_mxfp4_dispatch_mxfp8_combine", "moe_dispatch_nvfp4", "moe_combine_fp8"]


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = MegaMoEExperts(num_experts=E, top_k=K, hidden=H, intermediate=INTER,
                                      max_num_tokens=TMAX, device="cpu", weights=WEIGHTS)


def _batch(seed: int, tokens: int = 24):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, H, generator=g) * (1 + seed)).to(torch.bfloat16)
    w, ids = torch.randn(tokens, E, generator=g).softmax(-1).topk(K)
    return x, w.float(), ids


def _run(model, batch):
    with forward_context():
        return model.experts(*batch)


def _loop(model):
    for seed in (1, 2):
        _run(model, _batch(seed))


@pytest.fixture(autouse=True)
def _fresh_checks(modelopt_registered):
    reset_layout_checks()
    yield
    reset_layout_checks()


def _state(layer):
    out = {}
    for attr in ("dispatch_quantizer", "combine_quantizer"):
        q = getattr(layer.experts, attr)
        amax = q.static_amax
        fmt = mw_mo.format_name(q) if isinstance(q, mw_mo.WireTensorQuantizer) else q.fmt.name
        enabled = q.mode != "disabled"
        # ModelOpt also calibrates an amax for MX formats; only global-amax formats use one.
        uses_amax = enabled and formats.get(fmt).needs_amax
        out[attr] = (enabled, fmt if enabled else None,
                     float(amax) if uses_amax and amax is not None else None)
    return out


@pytest.mark.parametrize("name", SPELLED)
def test_round_trip_through_mtq_quantize(name):
    entries = recipes.to_modelopt(name)
    for entry in entries:
        assert set(entry) <= {"quantizer_name", "cfg", "enable"}
        assert not {"format", "allow_dynamic", "units"} & set(entry.get("cfg", {}))
    theirs = Layer()
    mtq.quantize(theirs, {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *entries],
                          "algorithm": "max"}, _loop)
    ours = Layer()
    moewire.quantize(ours, name, forward_loop=_loop)
    assert _state(theirs) == _state(ours)
    assert any(enabled for enabled, _, _ in _state(ours).values())
    formats = {fmt for _, fmt, _ in _state(ours).values() if fmt}
    if formats <= set(mw_mo.BIT_EXACT):
        batch = _batch(9)
        y_theirs, y_ours = _run(theirs, batch), _run(ours, batch)
        assert torch.equal(y_theirs.view(torch.int16), y_ours.view(torch.int16))


def test_moewire_keys_are_respelled():
    assert recipes.to_modelopt("moe_fp8_dispatch_nvfp4_combine") == [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}},
        {"quantizer_name": "*combine_quantizer",
         "cfg": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic",
                                                     "scale_bits": (4, 3)}, "axis": None}},
    ]


def test_use_constant_amax_round_trips_as_constant_amax(tmp_path):
    path = tmp_path / "pinned.yaml"
    path.write_text(textwrap.dedent("""\
        quant_cfg:
          - quantizer_name: "*dispatch_quantizer"
            cfg: {format: fp8, use_constant_amax: true}
          - quantizer_name: "*combine_quantizer"
            enable: false
    """))
    entries = recipes.to_modelopt(path)
    assert entries[0]["cfg"] == {"num_bits": (4, 3), "axis": None, "constant_amax": 448.0}
    assert entries[1] == {"quantizer_name": "*combine_quantizer", "enable": False}
    theirs = Layer()
    mtq.quantize(theirs, {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *entries],
                          "algorithm": "max"}, _loop)
    ours = Layer()
    moewire.quantize(ours, path, forward_loop=_loop)
    assert _state(theirs) == _state(ours)
    assert _state(ours)["dispatch_quantizer"] == (True, "fp8", 448.0)


def test_format_modelopt_cannot_spell_is_refused():
    with pytest.raises(ValueError, match="'logfmt10', which ModelOpt cannot spell"):
        recipes.to_modelopt("moe_combine_logfmt10")
