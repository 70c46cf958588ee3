"""Recipes: every packaged unit and preset loads; matching order; bad files name file:line."""

from __future__ import annotations

import re
import textwrap

import pytest

from moewire import recipes
from moewire.quantizer import WireQuantizer

UNITS = {
    "moe_dispatch_fp8": ("dispatch", "fp8"),
    "moe_dispatch_nvfp4": ("dispatch", "nvfp4"),
    "moe_dispatch_mxfp4": ("dispatch", "mxfp4"),
    "moe_combine_fp8": ("combine", "fp8"),
    "moe_combine_nvfp4": ("combine", "nvfp4"),
    "moe_combine_mxfp8": ("combine", "mxfp8"),
    "moe_combine_logfmt10": ("combine", "logfmt10"),
    "deepgemm_fp8_combine": ("combine", "deepgemm_fp8_combine"),
    "trtllm_fp8_combine": ("combine", "trtllm_32e4m3xe8m0"),
    "trtllm_fp4_combine": ("combine", "trtllm_16e2m1xbf16"),
    "te_mxfp8_combine": ("combine", "te_mxfp8"),
    "flashinfer_mxfp8_combine": ("combine", "flashinfer_mxfp8"),
    "flashinfer_nvfp4_combine": ("combine", "flashinfer_nvfp4"),
    "mori_fp8_combine_fnuz": ("combine", "mori_fp8_blockwise_fnuz"),
    "mori_fp8_combine_ocp": ("combine", "mori_fp8_blockwise_ocp"),
    "mori_fp8_direct_cast_combine_fnuz": ("combine", "mori_fp8_direct_cast_fnuz"),
    "mori_fp8_direct_cast_combine_ocp": ("combine", "mori_fp8_direct_cast_ocp"),
}
PRESETS = {
    "moe_fp8": ("fp8", "fp8"),
    "moe_nvfp4": ("nvfp4", "nvfp4"),
    "moe_fp8_dispatch_nvfp4_combine": ("fp8", "nvfp4"),
    "moe_mxfp4_dispatch_mxfp8_combine": ("mxfp4", "mxfp8"),
}
DISPATCH = "model.layers.3.mlp.experts.dispatch_quantizer"
COMBINE = "model.layers.3.mlp.experts.combine_quantizer"


def test_names_lists_every_packaged_recipe():
    assert recipes.names() == sorted({*UNITS, *PRESETS})


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_loads_and_targets_one_quantizer(name):
    side, fmt = UNITS[name]
    recipe = recipes.load(name)
    assert recipe.name == name and recipe.description
    assert len(recipe.entries) == 1
    mine, other = (DISPATCH, COMBINE) if side == "dispatch" else (COMBINE, DISPATCH)
    q = WireQuantizer.from_cfg(recipe.match(mine))
    assert q.fmt.name == fmt and q.enabled
    assert recipe.match(other) is None
    source = recipe.entries[0].source
    assert re.fullmatch(rf".*/recipes/{name}\.yaml:\d+", source), source


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_composes_units(name):
    dispatch, combine = PRESETS[name]
    recipe = recipes.load(name)
    assert len(recipe.units) == 2 and len(recipe.entries) == 2
    assert WireQuantizer.from_cfg(recipe.match(DISPATCH)).fmt.name == dispatch
    assert WireQuantizer.from_cfg(recipe.match(COMBINE)).fmt.name == combine
    assert recipe.match("model.layers.3.mlp.gate") is None


def test_combine_units_with_a_global_amax_forbid_a_per_call_amax():
    for name in ("moe_combine_fp8", "moe_combine_nvfp4"):
        q = WireQuantizer.from_cfg(recipes.load(name).match(COMBINE))
        assert not q.allow_dynamic and not q.is_static_scale()


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_match_wildcards_and_later_entries_win(tmp_path):
    path = _write(tmp_path, "mine.yaml", """
        description: test
        quant_cfg:
          - quantizer_name: "*"
            enable: false
          - quantizer_name: "*experts.*_quantizer"
            cfg: {num_bits: [4, 3]}
          - quantizer_name: "*layers.0.*combine_quantizer"
            cfg: {format: mxfp8}
          - quantizer_name: "*layers.1.*"
            enable: false
          - quantizer_name: "*layers.2.*dispatch_quantizer"
            cfg: {num_bits: [2, 1], block_sizes: {-1: 16, type: dynamic, scale_bits: [4, 3]}}
            enable: false
          - quantizer_name: "*layers.2.*dispatch_quantizer"
            enable: true
        """)
    recipe = recipes.load(path)
    assert recipe.name == "mine" and len(recipe.entries) == 6
    assert recipe.match("layers.0.experts.dispatch_quantizer") == {
        "num_bits": [4, 3], "enable": True}
    assert recipe.match("layers.0.experts.combine_quantizer") == {"format": "mxfp8",
                                                                  "enable": True}
    assert recipe.match("layers.1.experts.dispatch_quantizer") == {
        "num_bits": [4, 3], "enable": False}
    assert recipe.match("layers.2.experts.dispatch_quantizer")["enable"] is True
    assert WireQuantizer.from_cfg(recipe.match("layers.2.experts.dispatch_quantizer")).fmt.name \
        == "nvfp4"
    assert recipe.match("layers.0.gate") == {"enable": False}
    assert recipe.match("LAYERS.0.EXPERTS.DISPATCH_QUANTIZER") == {"enable": False}


def test_match_without_any_entry_is_none():
    recipe = recipes.Recipe.from_entries(
        [{"quantizer_name": "*combine_quantizer", "cfg": {"format": "logfmt10"}}])
    assert recipe.match("x.dispatch_quantizer") is None
    assert recipe.match("x.combine_quantizer") == {"format": "logfmt10", "enable": True}


def test_cfg_enable_false_is_kept_when_the_entry_sets_none():
    recipe = recipes.Recipe.from_entries(
        [{"quantizer_name": "*", "cfg": {"num_bits": (4, 3), "enable": False}}])
    assert recipe.match("a.dispatch_quantizer")["enable"] is False


def test_user_preset_takes_sibling_units_then_packaged(tmp_path):
    _write(tmp_path, "my_combine.yaml", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            cfg: {num_bits: [4, 3], constant_amax: 64.0}
        """)
    path = _write(tmp_path, "preset.yaml", """
        units: [moe_dispatch_nvfp4, my_combine]
        quant_cfg:
          - quantizer_name: "*layers.9.*"
            enable: false
        """)
    recipe = recipes.load(str(path))
    assert recipe.units == ("moe_dispatch_nvfp4", "my_combine")
    q = WireQuantizer.from_cfg(recipe.match(COMBINE))
    assert q.fmt.name == "fp8" and q.constant_amax == 64.0
    assert recipe.match("layers.9.experts.combine_quantizer")["enable"] is False


def test_top_level_list_is_a_recipe(tmp_path):
    path = _write(tmp_path, "flat.yaml", """
        - quantizer_name: "*dispatch_quantizer"
          cfg: {format: fp8_b32_ue8m0}
        """)
    assert recipes.load(path).match(DISPATCH) == {"format": "fp8_b32_ue8m0", "enable": True}


# -- bad files ------------------------------------------------------------------------------

_BAD = [
    ("unknown-format", """
        quant_cfg:
          - quantizer_name: "*dispatch_quantizer"
            cfg:
              format: fp6
        """, 4, "format='fp6' is not a registered wire format"),
    ("unknown-cfg-key", """
        quant_cfg:
          - quantizer_name: "*dispatch_quantizer"
            cfg:
              num_bits: [4, 3]
              calibrator: max
        """, 5, "unknown cfg key 'calibrator'; accepted keys: num_bits"),
    ("bad-num-bits", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            cfg:
              axis: null
              num_bits: [4, 3, 2]
        """, 5, "not a pair"),
    ("int-num-bits", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            cfg: {num_bits: 8}
        """, 3, "integer quantization"),
    ("bad-scale-bits", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            cfg:
              num_bits: [2, 1]
              block_sizes:
                -1: 16
                type: dynamic
                scale_bits: four
        """, 8, "block_sizes.scale_bits='four' is not a pair"),
    ("static-blocks", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            cfg:
              num_bits: [2, 1]
              block_sizes:
                -1: 16
                type: static
        """, 7, "set type: dynamic"),
    ("no-format", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            cfg:
              constant_amax: 3.0
        """, 4, "names no format"),
    ("unknown-entry-key", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
            parent_class: nn.Linear
            cfg: {num_bits: [4, 3]}
        """, 3, "unknown entry key 'parent_class'"),
    ("unknown-top-key", """
        algorithm: max
        quant_cfg: []
        """, 1, "unknown recipe key 'algorithm'"),
    ("entry-without-cfg-or-enable", """
        quant_cfg:
          - quantizer_name: "*combine_quantizer"
        """, 2, "needs cfg, enable or both"),
    ("no-quantizer-name", """
        quant_cfg:
          - cfg: {num_bits: [4, 3]}
        """, 2, "quantizer_name must be a wildcard"),
    ("enable-text", """
        quant_cfg:
          - quantizer_name: "*"
            enable: maybe
        """, 3, "enable must be true or false"),
    ("entries-not-list", """
        quant_cfg:
          quantizer_name: "*"
        """, 2, "quant_cfg must be a list"),
    ("duplicate-key", """
        quant_cfg:
          - quantizer_name: "*"
            cfg:
              num_bits: [4, 3]
              num_bits: [2, 1]
        """, 5, "appears twice (first at line 4)"),
    ("unknown-unit", """
        units: [moe_dispatch_fp8, moe_dispatch_fp6]
        """, 1, "unit 'moe_dispatch_fp6': unknown recipe 'moe_dispatch_fp6'; packaged recipes:"),
    ("no-entries", """
        description: nothing
        """, 1, "has no entries"),
    ("bad-yaml", """
        quant_cfg:
          - quantizer_name: "*"
            cfg: {num_bits: [4, 3}
        """, 3, "not valid YAML"),
    ("scalar", """
        moe_fp8
        """, 1, "a recipe is a mapping"),
]


@pytest.mark.parametrize(("text", "line", "match"), [b[1:] for b in _BAD],
                         ids=[b[0] for b in _BAD])
def test_bad_recipe_names_file_and_line(tmp_path, text, line, match):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(ValueError) as info:
        recipes.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert match in message, message


def test_bad_unit_points_at_both_files(tmp_path):
    _write(tmp_path, "inner.yaml", """
        quant_cfg:
          - quantizer_name: "*"
            cfg: {format: fp6}
        """)
    outer = _write(tmp_path, "outer.yaml", """
        description: x
        units: [inner]
        """)
    with pytest.raises(ValueError) as info:
        recipes.load(outer)
    assert str(info.value).startswith(f"{outer}:2: unit 'inner': {tmp_path / 'inner.yaml'}:3: ")


def test_unit_cycle_refused(tmp_path):
    _write(tmp_path, "a.yaml", "units: [b]\n")
    _write(tmp_path, "b.yaml", "units: [a]\n")
    with pytest.raises(ValueError, match="cycle"):
        recipes.load(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    ("arg", "match"),
    [("moe_fp6", "unknown recipe 'moe_fp6'; packaged recipes: deepgemm_fp8_combine, "
                 "flashinfer_mxfp8_combine"),
     ("missing/recipe.yaml", "does not exist")],
    ids=["unknown-name", "missing-file"],
)
def test_load_refuses_unknown_names(arg, match):
    with pytest.raises(ValueError, match=match):
        recipes.load(arg)


@pytest.mark.parametrize(
    ("entries", "match"),
    [([{"quantizer_name": "*", "cfg": {"num_bits": (5, 2)}}], r"custom\[0\]: \*: "),
     ([{"quantizer_name": "*", "enable": True}, {"pattern": "*"}],
      r"custom\[1\]: unknown entry key")],
    ids=["bad-cfg", "bad-key"],
)
def test_from_entries_validates(entries, match):
    with pytest.raises(ValueError, match=match):
        recipes.Recipe.from_entries(entries)


# -- unreadable files, enable-only entries, ModelOpt cfg dicts ------------------------


@pytest.mark.parametrize(
    ("data", "line", "match"),
    [(b"quant_cfg:\n  - {quantizer_name: '*', cfg: {format: fp8}}\x00\n", 2,
      r"not valid YAML: the character '\\x00'"),
     (b"description: caf\xe9\nquant_cfg: []\n", 1, r"not UTF-8 text \(byte 0xe9")],
    ids=["nul-byte", "latin-1"],
)
def test_unreadable_bytes_name_file_and_line(tmp_path, data, line, match):
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match) as info:
        recipes.load(path)
    assert str(info.value).startswith(f"{path}:{line}: ")


def test_enable_only_entry_without_cfg_names_the_quantizer_and_entry():
    recipe = recipes.Recipe.from_entries(
        [{"quantizer_name": "*", "enable": False},
         {"quantizer_name": "*combine_quantizer", "enable": True}])
    assert recipe.match("layers.0.experts.dispatch_quantizer") == {"enable": False}
    with pytest.raises(ValueError, match=r"custom\[1\]: \*combine_quantizer: enables the wire "
                                         r"quantizer layers.0.experts.combine_quantizer, but no "
                                         r"earlier entry gave it a cfg"):
        recipe.match("layers.0.experts.combine_quantizer")


@pytest.mark.parametrize("entries", [[], ()], ids=["list", "tuple"])
def test_from_entries_refuses_an_empty_recipe(entries):
    with pytest.raises(ValueError, match="has no entries, so it would quantize nothing"):
        recipes.Recipe.from_entries(entries)


@pytest.mark.parametrize("entries", ["*", {"quantizer_name": "*"}, 3],
                         ids=["str", "dict", "int"])
def test_from_entries_refuses_a_non_list(entries):
    with pytest.raises(TypeError, match="must be a list of dicts"):
        recipes.Recipe.from_entries(entries)


def test_modelopt_entries_defer_what_does_not_apply_to_wire_quantizers():
    entries = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer",
         "cfg": {"num_bits": (2, 1), "effective_bits": 4.5}},
        {"quantizer_name": "*", "parent_class": "nn.BatchNorm1d", "enable": False},
        {"quantizer_name": "*combine_quantizer", "cfg": {"num_bits": (4, 3)}},
    ]
    with pytest.raises(ValueError, match="unknown cfg key 'effective_bits'"):
        recipes.Recipe.from_entries(entries)
    recipe = recipes.Recipe.from_entries(entries, modelopt=True)
    assert recipe.match("l.0.experts.combine_quantizer") == {"num_bits": (4, 3), "enable": True}
    assert recipe.match("l.0.experts.dispatch_quantizer") == {"enable": False}
    bad = recipes.Recipe.from_entries(
        [{"quantizer_name": "*quantizer", "cfg": {"num_bits": (2, 1), "effective_bits": 4.5}}],
        name="quant_cfg", modelopt=True)
    with pytest.raises(ValueError, match=r"quant_cfg\[0\]: \*quantizer: matches the wire "
                                         r"quantizer x.combine_quantizer, and unknown cfg key"):
        bad.match("x.combine_quantizer")
