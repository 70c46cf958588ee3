"""Scales files: every malformed, truncated, corrupted or foreign file is a ValueError that
names the file, and a refused load leaves the model exactly as it was."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rb_helpers import RECIPE, Model, calibrated, outputs, snapshot, tried
from safetensors.torch import save_file

import moewire
from moewire.megamoe.api import quantizers
from moewire.megamoe.scales_file import Scale, write_scales
from moewire.quantizer import WireQuantizer

SUFFIXES = [".json", ".safetensors"]


def _refused(model, path, match=None, **kwargs):
    """load_scales must raise a ValueError naming ``path`` and change nothing."""
    before = snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        moewire.load_scales(model, path, **kwargs)
    assert str(path) in str(info.value), f"the error does not name the file: {info.value}"
    assert snapshot(model) == before
    tried()
    return str(info.value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A calibrated model's scales in both formats, and the model's outputs."""
    root = tmp_path_factory.mktemp("scales")
    model = calibrated()
    paths = {s: moewire.save_scales(model, root / f"scales{s}") for s in SUFFIXES}
    return paths, outputs(model)


def _fresh():
    return moewire.quantize(Model(), RECIPE)


def _safetensors_parts(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}, dict(f.metadata())  # noqa: SIM118


# -- a file that does not cover every quantizer that needs an amax ----------


def test_safetensors_missing_a_tensor_with_metadata_intact_is_refused(saved, tmp_path):
    tensors, meta = _safetensors_parts(saved[0][".safetensors"])
    del tensors["layers.1.experts.combine_quantizer"]
    path = tmp_path / "cut.safetensors"
    save_file(tensors, str(path), metadata=meta)
    _refused(_fresh(), path, r"layers.1.experts.combine_quantizer: the metadata says shape=\[\] "
                             r"but the file holds no tensor")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_file_without_amax_for_an_enabled_quantizer_is_refused(tmp_path, suffix):
    # save_scales refuses to write such a file (below): write the records themselves.
    uncalibrated = moewire.quantize(Model(), RECIPE)
    records = {
        name: Scale(q.fmt.name, None, None, name.endswith("combine_quantizer"))
        for name, _, q in quantizers(uncalibrated)
    }
    path = write_scales(tmp_path / f"dyn{suffix}", records)
    message = _refused(_fresh(), path, "holds no amax for")
    assert "layers.0.experts.dispatch_quantizer" in message
    assert "layers.1.experts.combine_quantizer" in message


def _partly_calibrated():
    model = calibrated()
    # A quantizer put in after calibration: enabled, NVFP4, no amax.
    model.layers[1].experts.combine_quantizer = WireQuantizer("nvfp4")
    return model


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: moewire.quantize(Model(), RECIPE), "layers.0.experts.dispatch_quantizer"),
        (_partly_calibrated, "layers.1.experts.combine_quantizer"),
    ],
    ids=["never-calibrated", "one-quantizer-lost-its-amax"],
)
def test_save_scales_refuses_a_model_without_the_amax_it_needs(tmp_path, suffix, build, named):
    """Scales of a model never calibrated used to be written without a word and
    fail only when a server loaded them. Break: drop the check in save_scales: a file is
    written and no error raised."""
    path = tmp_path / f"s{suffix}"
    with pytest.raises(ValueError, match=r"save_scales: .*never calibrated.*Run "
                                         r"moewire\.calibrate\(model, forward_loop\)") as info:
        moewire.save_scales(build(), path)
    assert named in str(info.value)
    assert not path.exists()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_disabled_quantizer_needs_no_amax(tmp_path, suffix):
    recipe = {"quant_cfg": [*RECIPE["quant_cfg"],
                            {"quantizer_name": "*dispatch_quantizer", "enable": False}]}
    source = moewire.quantize(Model(), recipe, forward_loop=_loop_of())
    path = moewire.save_scales(source, tmp_path / f"s{suffix}")
    target = moewire.quantize(Model(), recipe)
    assert moewire.load_scales(target, path) == ["layers.0.experts.combine_quantizer",
                                                 "layers.1.experts.combine_quantizer"]


def _loop_of():
    from rb_helpers import loop

    return loop


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_extra_names_are_refused_unless_asked_for(saved, suffix):
    small = moewire.quantize(Model(n=1), RECIPE)
    _refused(small, saved[0][suffix], r"has scales for \['layers.1.experts")
    loaded = moewire.load_scales(small, saved[0][suffix], allow_extra=True)
    assert loaded == ["layers.0.experts.dispatch_quantizer", "layers.0.experts.combine_quantizer"]


# -- an amax of any dtype but FP32 is refused ---------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.float8_e4m3fn, torch.int64, torch.float64, torch.bfloat16],
    ids=["bool", "fp8", "int64", "float64", "bf16"],
)
def test_safetensors_amax_dtype_other_than_fp32_is_refused(saved, tmp_path, dtype):
    tensors, meta = _safetensors_parts(saved[0][".safetensors"])
    name = "layers.0.experts.dispatch_quantizer"
    tensors[name] = tensors[name].to(dtype)
    path = tmp_path / "dtype.safetensors"
    save_file(tensors, str(path), metadata=meta)
    _refused(_fresh(), path, f"{name}: the amax is {dtype}; an amax is stored as FP32")


@pytest.mark.parametrize(
    ("amax", "match"),
    [([True], "not a list of numbers"), (["1.5"], "not a list of numbers"),
     ([0.1], r"not an FP32 value"), (1.5, "not a list of numbers")],
    ids=["bool", "string", "not-fp32-exact", "scalar-not-list"],
)
def test_json_amax_that_is_not_fp32_is_refused(saved, tmp_path, amax, match):
    data = json.loads(saved[0][".json"].read_text())
    data["quantizers"]["layers.0.experts.dispatch_quantizer"]["amax"] = amax
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    _refused(_fresh(), path, match)


# -- malformed files: each a ValueError naming the file ---------------------------------------


def _json_edit(edit):
    def make(saved, path):
        data = json.loads(saved[".json"].read_text())
        edit(data)
        path = path.with_suffix(".json")
        path.write_text(json.dumps(data))
        return path

    return make


def _raw(suffix, data: bytes):
    def make(saved, path):
        path = path.with_suffix(suffix)
        path.write_bytes(data)
        return path

    return make


def _truncated(suffix, keep):
    def make(saved, path):
        data = saved[suffix].read_bytes()
        path = path.with_suffix(suffix)
        path.write_bytes(data[: keep(len(data))])
        return path

    return make


def _safetensors_as_bin(saved, path):
    path = path.with_suffix(".bin")
    path.write_bytes(saved[".safetensors"].read_bytes())
    return path


def _safetensors_meta(edit):
    def make(saved, path):
        tensors, meta = _safetensors_parts(saved[".safetensors"])
        path = path.with_suffix(".safetensors")
        save_file(tensors, str(path), metadata=edit(meta))
        return path

    return make


def _doc_edit(edit):
    def change(meta):
        doc = json.loads(meta["moewire_scales"])
        edit(doc)
        return {"moewire_scales": json.dumps(doc)}

    return _safetensors_meta(change)


MALFORMED = [
    ("json-no-quantizers", _json_edit(lambda d: d.pop("quantizers")), "'quantizers' is a"),
    ("json-quantizers-list", _json_edit(lambda d: d.update(quantizers=[1])), "not a mapping"),
    ("json-entry-str", _json_edit(lambda d: d["quantizers"].update(
        {"layers.0.experts.dispatch_quantizer": "fp8"})), "is a str, not a mapping"),
    ("json-format-int", _json_edit(lambda d: d["quantizers"][
        "layers.0.experts.dispatch_quantizer"].update(format=8)), "not a format name"),
    ("json-shape-str", _json_edit(lambda d: d["quantizers"][
        "layers.0.experts.dispatch_quantizer"].update(shape="[]")), "not a list of sizes"),
    ("json-version-3", _json_edit(lambda d: d.update(moewire_scales=3)), "version is 3"),
    ("json-version-true", _json_edit(lambda d: d.update(moewire_scales=True)),
     "version is True"),
    ("json-top-list", _raw(".json", b"[1, 2]"), "no 'moewire_scales' key"),
    ("json-empty", _raw(".json", b""), "not JSON"),
    ("json-truncated", _truncated(".json", lambda n: n // 2), "not JSON"),
    ("json-latin1", _raw(".json", b'{"caf\xe9": 1}'), "not JSON"),
    ("safetensors-empty", _raw(".safetensors", b""), "not a readable safetensors file"),
    ("safetensors-truncated", _truncated(".safetensors", lambda n: n - 3),
     "not a readable safetensors file"),
    ("safetensors-header-only", _truncated(".safetensors", lambda n: 8),
     "not a readable safetensors file"),
    ("safetensors-as-bin", _safetensors_as_bin, r"has the suffix '\.bin'.*rename it"),
    ("safetensors-no-metadata", _safetensors_meta(lambda m: {"other": "x"}),
     "no 'moewire_scales' metadata"),
    ("safetensors-metadata-not-json", _safetensors_meta(lambda m: {"moewire_scales": "{"}),
     "metadata is not JSON"),
    ("safetensors-version-0", _doc_edit(lambda d: d.update(version=0)), "version is 0"),
    ("safetensors-no-version", _doc_edit(lambda d: d.pop("version")), "version is None"),
    ("safetensors-no-quantizers", _doc_edit(lambda d: d.pop("quantizers")),
     "has no 'quantizers'"),
    ("safetensors-unlisted-tensor", _doc_edit(lambda d: d["quantizers"].pop(
        "layers.0.experts.dispatch_quantizer")), "tensors .* its metadata does not list"),
]


@pytest.mark.parametrize(("make", "match"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_file_is_a_value_error_naming_it(saved, tmp_path, make, match):
    _refused(_fresh(), make(saved[0], tmp_path / "bad"), match)


@pytest.mark.parametrize("path", [3, None, b"x.json"], ids=["int", "None", "bytes"])
def test_path_of_the_wrong_type_is_a_type_error(path):
    model = _fresh()
    with pytest.raises(TypeError, match="load_scales: path must be a str or os.PathLike"):
        moewire.load_scales(model, path)
    with pytest.raises(TypeError, match="save_scales: path must be a str or os.PathLike"):
        moewire.save_scales(model, path)
    tried(2)


def test_missing_file_is_a_value_error_naming_it(tmp_path):
    _refused(_fresh(), tmp_path / "nope.json", "does not exist")


# -- fuzzing: corrupted bytes --------------------------------------------------------------------


def _header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(suffix=st.sampled_from(SUFFIXES), cut=st.floats(0, 1), flips=st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), max_size=4))
def test_fuzzed_file_is_refused_naming_it_or_loads_what_it_says(saved, tmp_path_factory, suffix,
                                                                cut, flips):
    """Truncate the file and XOR random bytes (of the JSON text, of the safetensors
    header). The load either refuses with a ValueError naming the file and leaves the model
    unchanged, or the edit left a valid file and the load gives what the file holds."""
    data = bytearray(saved[0][suffix].read_bytes())
    end = len(data) if suffix == ".json" else _header_end(bytes(data))
    for where, mask in flips:
        data[int(where * end)] ^= mask
    data = bytes(data[: max(1, round(cut * len(data)))]) if cut < 1 else bytes(data)
    path = tmp_path_factory.mktemp("fuzz") / f"f{suffix}"
    path.write_bytes(data)
    model = _fresh()
    before = snapshot(model)
    tried()
    try:
        names = moewire.load_scales(model, path)
    except ValueError as err:
        assert str(path) in str(err), err
        assert snapshot(model) == before
        return
    assert names  # a benign edit (whitespace, a key's order): the values it holds loaded
    for name, _, q in moewire.megamoe.api.quantizers(model):
        assert q.has_amax and torch.isfinite(q.amax) and q.amax >= 0, name


# -- the round trip and the file mode ---------------------------------------------------------


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip_gives_the_calibrated_outputs(saved, suffix):
    model = _fresh()
    moewire.load_scales(model, saved[0][suffix])
    for got, want in zip(outputs(model), saved[1], strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_scales_files_respect_the_umask(tmp_path, suffix, umask):
    model = calibrated(n=1)
    old = os.umask(umask)
    try:
        path = moewire.save_scales(model, tmp_path / f"s{suffix}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    tried()
