"""Kernel tests: on a machine without CUDA they run under Triton's interpreter.

``TRITON_INTERPRET`` must be set before Triton is first imported (``triton.jit`` reads it
when a kernel is defined), so it is set here, at collection, when there is no GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _patches_undone(patches_undone):
    """Tests here may quantize models and drop them: their patches are undone after each."""
    yield
