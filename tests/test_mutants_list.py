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
    """The suites that name only tests run together in one process, the ``-k`` suites of the
    same paths together with their expressions or-ed, any other suite with options alone,
    and every suite's tests are in some run. Break: drop the suites with options, merge a
    ``-k`` into the shared run (it would deselect other suites' tests), or merge ``-k``
    suites of different paths."""
    suites = sorted({m.tests for m in LIST})
    runs = mutants.unmutated_runs(suites)
    shared, *rest = runs
    assert not any(arg.startswith("-") for arg in shared)
    for suite in suites:
        if not any(a.startswith("-") for a in suite):
            assert set(suite) <= set(shared)
        elif suite[-2] == "-k" and not any(a.startswith("-") for a in suite[:-2]):
            [run] = [r for r in rest if r[:-2] == suite[:-2] and r[-2] == "-k"]
            assert f"({suite[-1]})" in run[-1]
        else:
            assert suite in rest
    assert len(rest) == len(set(r[:-1] if r[-2:-1] == ("-k",) else r for r in rest))
    assert len(runs) < len(suites) / 2  # the point of merging: few process starts
    assert len(shared) == len(set(shared))
