"""``moewire.quantizer`` is a package of one file per job (``config``, ``contract``,
``state``, ``calibrate``, ``binding``): the names it exported as one module still import
from it, a model pickled before the split loads, and its modules import only the layer below
(``formats``) and each other, never the package itself (its ``__init__`` imports them: that
would be a cycle).
"""

from __future__ import annotations

import ast
import io
import pickle
from pathlib import Path

import pytest
import torch

import moewire.quantizer
from moewire.quantizer import WireQuantizer, config, contract

PACKAGE = "moewire.quantizer"
ROOT = Path(moewire.quantizer.__file__).parent
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))
BELOW = ("moewire.formats",)


def _imported(module: str) -> set[str]:
    """Every ``moewire...`` name ``module`` imports (``from P import x``: ``P.x``), lazy
    imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{PACKAGE}.{module}: relative import; spell it out"
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("moewire.")}


def test_the_names_of_the_one_module_still_import_from_the_package():
    assert sorted(moewire.quantizer.__all__) == sorted([
        "MODES", "CfgError", "WireQuantizer", "WireQuantizerLike", "calibration",
        "max_all_reduce", "parse_cfg",
    ])
    assert moewire.quantizer.MODES == ("quantize", "calibrate", "disabled")
    for name in ("WireQuantizerLike", "calibration", "max_all_reduce"):
        assert getattr(moewire.quantizer, name) is getattr(contract, name)
    for name in ("CfgError", "parse_cfg"):
        assert getattr(moewire.quantizer, name) is getattr(config, name)


def test_a_pickle_naming_the_old_module_loads(monkeypatch):
    """A WireQuantizer pickled before the split names ``moewire.quantizer.WireQuantizer``."""
    q = WireQuantizer("nvfp4", name="model.layers.0.experts.combine_quantizer")
    q.load_amax(torch.tensor(5.25))
    monkeypatch.setattr(WireQuantizer, "__module__", PACKAGE)
    data = io.BytesIO()
    pickle.dump(q, data)
    monkeypatch.undo()
    assert b"moewire.quantizer.binding" not in data.getvalue()
    loaded = pickle.loads(data.getvalue())
    assert type(loaded) is WireQuantizer
    assert (loaded.has_amax, loaded.amax_source, float(loaded.amax)) == (True, "loaded", 5.25)
    assert repr(loaded) == repr(q)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_only_the_layers_below_and_its_siblings(module):
    allowed = BELOW + tuple(f"{PACKAGE}.{m}" for m in MODULES if m not in (module, "__init__"))
    wrong = {n for n in _imported(module)
             if not any(n == a or n.startswith(f"{a}.") for a in allowed)}
    assert not wrong, f"{PACKAGE}.{module} imports {sorted(wrong)}"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_docstring_says_what_it_may_import(module):
    doc = ast.get_docstring(ast.parse((ROOT / f"{module}.py").read_text())) or ""
    assert "May import:" in doc, f"{PACKAGE}.{module}: opening docstring lacks it"
