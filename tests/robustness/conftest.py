"""Prints how many cases the robustness suite tried (``rb_helpers.tried``) after the run."""

from __future__ import annotations

import pytest
from rb_helpers import TRIED


def pytest_terminal_summary(terminalreporter):
    if TRIED["cases"]:
        terminalreporter.write_line(f"robustness suite: {TRIED['cases']} cases tried")


@pytest.fixture(autouse=True)
def _patches_undone(patches_undone):
    """Tests here quantize models and drop them: their patches are undone after each."""
    yield
