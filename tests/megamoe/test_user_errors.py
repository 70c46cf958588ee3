"""Mistakes a user makes with the public API end in an error that names the cause and the
fix, never in a silent pass or a raw traceback: recipe entries that match nothing, scales
of another layer shape, scale-file suffixes and directories, a forward_loop without the
model argument, and the names the messages point at."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import moewire
from moewire.megamoe import layout_check
from moewire.reference import MegaMoEExperts

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


class Layer(nn.Module):
    def __init__(self, experts: int = 16, hidden: int = 128, top_k: int = 4) -> None:
        super().__init__()
        self.experts = MegaMoEExperts(experts, top_k, hidden, 128, 16,
                                      mma_type="bf16xbf16", seed=0)


def loop_for(layer: Layer, seed: int = 0):
    def forward_loop(model):
        g = torch.Generator().manual_seed(seed)
        e, h, k = layer.experts.num_experts, layer.experts.hidden, layer.experts.top_k
        x = torch.randn(16, h, generator=g).bfloat16()
        w, ids = torch.randn(16, e, generator=g).softmax(-1).topk(k)
        model.experts(x, w.float(), ids)

    return forward_loop


def calibrated(experts=16, hidden=128, top_k=4) -> Layer:
    layer = Layer(experts, hidden, top_k)
    return moewire.quantize(layer, "moe_fp8_dispatch_nvfp4_combine",
                            forward_loop=loop_for(layer))


@pytest.mark.parametrize(
    "entries",
    [
        [{"quantizer_name": "*dispatch_quantizer", "cfg": {"num_bits": (4, 3)}},
         {"quantizer_name": "*combin_quantizer", "cfg": NVFP4}],
        [{"quantizer_name": "*dispatch_quantizer", "cfg": {"num_bits": (4, 3)}},
         {"quantizer_name": "*Combine_quantizer", "cfg": NVFP4}],
    ],
    ids=["typo", "case"],
)
def test_a_recipe_entry_that_matches_no_quantizer_is_refused(entries):
    layer = Layer()
    pattern = entries[1]["quantizer_name"]
    with pytest.raises(ValueError) as err:
        moewire.quantize(layer, {"quant_cfg": entries})
    text = str(err.value)
    assert repr(pattern) in text
    assert "experts.dispatch_quantizer" in text and "experts.combine_quantizer" in text
    assert not hasattr(layer.experts, "combine_quantizer")  # nothing was converted


@pytest.mark.parametrize(
    "entry",
    [
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3)}},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3)}},
        {"quantizer_name": "layers.7.experts.combine_quantizer", "cfg": NVFP4},
    ],
    ids=["modelopt-input", "modelopt-weight", "a-layer-this-model-lacks"],
)
def test_entries_meant_for_other_quantizers_or_layers_pass(entry):
    recipe = {"quant_cfg": [{"quantizer_name": "*combine_quantizer", "cfg": NVFP4}, entry]}
    layer = moewire.quantize(Layer(), recipe)
    assert layer.experts.combine_quantizer.fmt.name == "nvfp4"


@pytest.mark.parametrize(
    "other",
    [dict(experts=32), dict(hidden=256), dict(top_k=2)],
    ids=["experts", "hidden", "top-k"],
)
@pytest.mark.parametrize("suffix", [".safetensors", ".json", ".pt"])
def test_scales_of_another_layer_shape_are_refused(tmp_path, other, suffix):
    path = moewire.save_scales(calibrated(), tmp_path / f"s{suffix}")
    target = Layer(**{"experts": 16, "hidden": 128, "top_k": 4, **other})
    moewire.quantize(target, "moe_fp8_dispatch_nvfp4_combine")
    with pytest.raises(ValueError) as err:
        moewire.load_scales(target, path)
    text = str(err.value)
    assert "E=16 H=128 k=4" in text
    want = {"experts": 16, "hidden": 128, "top_k": 4, **other}
    assert f"E={want['experts']} H={want['hidden']} k={want['top_k']}" in text
    assert "experts.dispatch_quantizer" in text


@pytest.mark.parametrize("suffix", [".safetensors", ".json", ".pt"])
def test_each_suffix_writes_its_own_encoding_and_loads_back(tmp_path, suffix):
    source = calibrated()
    path = moewire.save_scales(source, tmp_path / f"s{suffix}")
    data = path.read_bytes()
    if suffix == ".json":
        assert json.loads(data)["moewire_scales"] == 2
    elif suffix == ".pt":
        assert torch.load(path, weights_only=True)["moewire_scales"] == 2
    else:
        assert b"moewire_scales" in data[:2000] and not data.startswith(b"{")
    target = Layer()
    moewire.quantize(target, "moe_fp8_dispatch_nvfp4_combine")
    loaded = moewire.load_scales(target, path)
    assert loaded == ["experts.dispatch_quantizer", "experts.combine_quantizer"]
    assert float(target.experts.combine_quantizer.static_amax) == float(
        source.experts.combine_quantizer.static_amax)


def test_a_version_1_file_without_the_layer_still_loads(tmp_path):
    path = moewire.save_scales(calibrated(), tmp_path / "s.json")
    doc = json.loads(path.read_text())
    doc["moewire_scales"] = 1
    for entry in doc["quantizers"].values():
        del entry["layer"]
    path.write_text(json.dumps(doc))
    target = Layer(experts=32)  # no shape recorded: nothing to compare
    moewire.quantize(target, "moe_fp8_dispatch_nvfp4_combine")
    assert len(moewire.load_scales(target, path)) == 2


@pytest.mark.parametrize(
    "name, call, needle",
    [
        ("scales.bin", "save", "has the suffix '.bin'"),
        ("scales", "save", "has the suffix '(none)'"),
        ("missing/dir/scales.json", "save", "the directory"),
        ("scales.txt", "load", "has the suffix '.txt'"),
    ],
    ids=["unknown-suffix", "no-suffix", "missing-directory", "load-unknown-suffix"],
)
def test_scale_paths_are_refused_with_the_fix(tmp_path, name, call, needle):
    model = calibrated()
    path = tmp_path / name
    with pytest.raises(ValueError, match=re.escape(needle)):
        if call == "save":
            moewire.save_scales(model, path)
        else:
            moewire.load_scales(model, path)
    assert not path.exists()


@pytest.mark.parametrize("call", ["quantize", "calibrate"])
def test_a_forward_loop_without_the_model_argument_is_refused(call):
    layer = Layer()

    def forward_loop():  # forgot the model argument
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"forward_loop\(\) cannot be called with the model"):
        if call == "quantize":
            moewire.quantize(layer, "moe_fp8_dispatch_nvfp4_combine", forward_loop=forward_loop)
        else:
            moewire.calibrate(moewire.quantize(layer, "moe_fp8_dispatch_nvfp4_combine"),
                              forward_loop)


def test_the_uncalibrated_save_names_a_function_that_exists(tmp_path):
    layer = moewire.quantize(Layer(), "moe_fp8_dispatch_nvfp4_combine")
    with pytest.raises(ValueError) as err:
        moewire.save_scales(layer, tmp_path / "s.json")
    named = re.findall(r"moewire\.(\w+)\(", str(err.value))
    assert "calibrate" in named
    for name in named:
        assert callable(getattr(moewire, name)), name
    moewire.calibrate(layer, loop_for(layer))  # what the message says, then the save works
    assert moewire.save_scales(layer, tmp_path / "s.json").is_file()


def test_python_dash_m_moewire_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "moewire", "formats", "--hidden", "512"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "nvfp4" in done.stdout and "bits/elem @H=512" in done.stdout
