"""``make mutants``'s list (scripts/mutants.toml) still matches the code it mutates.

A change to ``src/`` that moves a mutated line fails here, in ``make test``, naming the
mutant to update, rather than later in ``make mutants``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutants_module():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mutants = _mutants_module()
LIST = mutants.load()


@pytest.mark.parametrize("mutant", LIST, ids=[m.name for m in LIST])
def test_mutant_matches_the_code_and_changes_it(mutant):
    text = (ROOT / mutant.file).read_text()
    assert mutant.apply(text) != text
    for test in mutant.tests:
        if test.startswith("tests/"):
            assert (ROOT / test).exists(), f"{mutant.name}: no test file {test}"


def test_every_critical_spot_has_a_mutant():
    spots = {m.spot for m in LIST}
    assert {
        "summation order",
        "shared slot position",
        "E2M1 thresholds",
        "division forms",
        "calibration max",
        "layout-check comparison",
        "flavour table",
        "fused-kernel dispatch",
        "undo ledger",
        "site recognition",
        "build choice",
        "hook order",
        "time model",
        "suspected spots",
    } <= spots


def test_a_stale_mutant_is_refused_with_its_name():
    stale = mutants.Mutant("stale", "spot", "src/x.py", ("tests",), (("not in the file", "x"),))
    with pytest.raises(LookupError, match="mutant 'stale': its original text occurs 0 times"):
        stale.apply("some code")


def test_the_unmutated_runs_cover_every_suite_once():
    """The suites that name only tests run together in one process, each suite with options
    (``-k``) alone, and every suite's tests are in some run. Break: drop the suites with
    options, or merge a ``-k`` into the shared run (it would deselect other suites' tests)."""
    suites = sorted({m.tests for m in LIST})
    runs = mutants.unmutated_runs(suites)
    shared, *alone = runs
    assert not any(arg.startswith("-") for arg in shared)
    assert sorted(alone) == sorted(s for s in suites if any(a.startswith("-") for a in s))
    for suite in suites:
        assert suite in alone or set(suite) <= set(shared)
    assert len(shared) == len(set(shared))
