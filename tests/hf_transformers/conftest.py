"""transformers tests: skipped without transformers; every test runs with ``"moewire"``
registered and leaves the registries as it found them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def moewire_registered():
    import moewire.integrations.transformers as mt
    from moewire import patches

    mt.register()
    try:
        yield mt
    finally:
        patches.undo_all()
        mt.unregister()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``family -> path`` of tiny random BF16 checkpoints, written once per session."""
    import _tiny

    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = _tiny.checkpoint(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get
