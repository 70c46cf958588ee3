"""Shared fixtures: a small DeepSeek-named safetensors checkpoint and captured tokens."""

import pytest
import torch
from safetensors.torch import save_file
from study_helpers import HIDDEN, dense_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "layer.safetensors"
    tensors = dense_checkpoint()
    save_file(tensors, str(path))
    return path, tensors


@pytest.fixture(scope="session")
def activations(tmp_path_factory):
    path = tmp_path_factory.mktemp("acts") / "hidden.pt"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 24, HIDDEN, generator=g).bfloat16()
    torch.save(x, path)
    return path, x


@pytest.fixture(autouse=True)
def _patches_undone(patches_undone):
    """Tests here quantize models and drop them: their patches are undone after each."""
    yield
