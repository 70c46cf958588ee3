"""The suite's leak check (tests/conftest.py) names a test that leaves process-wide state.

Each case runs pytest in a child process on a scratch directory holding a copy of the
suite's conftest and a few tests, in a fixed order (``-p no:randomly``): leaky ones, and a
clean one after them that finds the state put back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moewire

pytestmark = pytest.mark.slow

_TESTS = Path(__file__).parent
_SRC = Path(moewire.__file__).parents[1]

_CASES = '''
import gc

from mm_helpers import Model

import moewire
from moewire import formats, patches
from moewire.megamoe import convert as convert_module
from moewire.megamoe import flavours, registry
from moewire.reference import MegaMoEExperts

RECIPE = [{"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]
KEPT = []


def Layer():
    return Model(n=1).layers[0]


def test_a_keeps_a_quantized_model():
    KEPT.append(moewire.quantize(Layer(), RECIPE))


def test_b_drops_a_quantized_model_without_unquantize():
    moewire.quantize(Layer(), RECIPE)


def test_c_registers_an_experts_class():
    class Mine(MegaMoEExperts):
        pass

    registry.register_experts_class(Mine, registry.adapter_for(Layer().experts))


def test_d_registers_a_format_and_a_flavour():
    class Wide(formats.WireFormat):
        name = "bf16_wide"
        element_bits = 16

    formats.register(Wide)
    old = flavours.get(flavours.names()[0])
    flavours.register(flavours.Flavour("leaky-build", dict(old.kernels)))


def test_e_finds_the_state_put_back():
    KEPT.clear()
    gc.collect()
    assert not convert_module._CONVERTED
    assert patches.active_patches() == []
    assert "leaky-build" not in flavours.names()
    assert not any(cls.__name__ == "Mine" for cls in registry.registered_classes())


def test_f_quantizes_and_unquantizes():
    model = moewire.quantize(Layer(), RECIPE)
    moewire.unquantize(model)
'''

# ModelOpt's first import keeps the importing call stack alive: imported in a test's body,
# it kept that test's locals (its quantized model). The conftest imports it before the
# first test of a run whose files use it.
_FIRST_IMPORT = '''
import pytest
from mm_helpers import Model

import moewire
from moewire import patches

RECIPE = [{"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]


def test_first_imports_modelopt_then_drops_its_quantized_model():
    pytest.importorskip("modelopt.torch.quantization")
    model = moewire.quantize(Model(n=1), RECIPE)
    assert model is not None
    patches.undo_all()
'''


def _pytest(tmp_path: Path, files: dict[str, str], *args: str) -> str:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_SRC), str(_TESTS / "megamoe")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-o", "addopts=", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    return run.stdout + run.stderr


def test_leak_check_names_each_leaking_test_and_what_it_left(tmp_path):
    """Break: drop a part of the check (the ledger, a registry): its case passes; drop the
    restore: test_e fails."""
    shutil.copy(_TESTS / "conftest.py", tmp_path / "conftest.py")
    out = _pytest(tmp_path, {"test_cases.py": _CASES}, "test_cases.py")
    expected = {
        "test_a_keeps_a_quantized_model": "converted module still alive: QuantMegaMoEExperts "
        "(experts)",
        "test_b_drops_a_quantized_model_without_unquantize": "undo-ledger entry: module "
        "moewire.reference.experts.stage_mega_moe_inputs",
        "test_c_registers_an_experts_class": "experts adapters (megamoe.registry): added or "
        "replaced test_cases.test_c_registers_an_experts_class.<locals>.Mine",
        "test_d_registers_a_format_and_a_flavour": "kernel flavours (megamoe.flavours): added "
        "or replaced 'leaky-build'",
    }
    for test, line in expected.items():
        assert f"ERROR test_cases.py::{test}" in out, out
        assert f"test_cases.py::{test} left process-wide state behind" in out, out
        assert line in out, out
    assert "wire formats (formats): added or replaced 'bf16_wide'" in out, out
    assert "DeepGEMM module still hooked: moewire.reference.deep_gemm" in out, out
    assert "6 passed, 4 errors" in out, out


@pytest.mark.modelopt
def test_a_test_that_first_imports_modelopt_keeps_nothing_alive(tmp_path):
    """Break: drop the import from the conftest's ``pytest_collection_finish``: the test's
    model stays alive and the check reports it."""
    pytest.importorskip("modelopt.torch.quantization")
    shutil.copy(_TESTS / "conftest.py", tmp_path / "conftest.py")
    out = _pytest(tmp_path, {"test_first_import.py": _FIRST_IMPORT}, "test_first_import.py")
    assert "1 passed" in out and "error" not in out, out


@pytest.mark.modelopt
def test_mtq_quantize_test_then_unquantize_tests_pass_in_that_order(tmp_path):
    """The order that failed: ModelOpt's first import, inside the mtq test, kept that test's
    model alive, and the unquantize tests' fixture then found a converted module. Break:
    drop the import from the conftest's ``pytest_collection_finish``."""
    pytest.importorskip("modelopt.torch.quantization")
    first = _TESTS / "robustness" / "test_robustness_quantize.py"
    then = _TESTS / "megamoe" / "test_megamoe_unquantize.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         f"{first}::test_quantize_after_mtq_quantize_keeps_modelopt_calibrated_amax",
         f"{then}::test_quantize_then_unquantize_runs_bit_identical_twice_in_a_row"],
        cwd=_TESTS.parent, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(_SRC)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout, run.stdout
