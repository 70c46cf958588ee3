"""eval tests: skipped without transformers; they reuse the tiny checkpoints of
tests/hf_transformers and leave transformers' registries as they found them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "hf_transformers"))


@pytest.fixture(autouse=True)
def moewire_unregistered_after():
    import moewire.integrations.transformers as mt
    from moewire import patches

    try:
        yield
    finally:
        patches.undo_all()
        mt.unregister()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(family, **shape)``: a tiny random checkpoint, written once per session."""
    pytest.importorskip("transformers.integrations.moe")
    import _tiny

    cache = {}

    def get(family, **shape):
        key = (family, tuple(sorted(shape.items())))
        if key not in cache:
            cache[key] = _tiny.checkpoint(family, tmp_path_factory.mktemp(family), **shape)
        return cache[key]

    return get
