"""Every test here may quantize models and drop them: their patches are undone after it."""

import pytest


@pytest.fixture(autouse=True)
def _patches_undone(patches_undone):
    yield
