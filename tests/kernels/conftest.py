"""Kernel tests: on a machine without CUDA they run under Triton's interpreter
(``TRITON_INTERPRET``, set by the suite's root ``tests/conftest.py`` before any test module,
and so Triton, is imported)."""

import pytest


@pytest.fixture(autouse=True)
def _patches_undone(patches_undone):
    """Tests here may quantize models and drop them: their patches are undone after each."""
    yield
