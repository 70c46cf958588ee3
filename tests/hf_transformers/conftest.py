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


@pytest.fixture(scope="session")
def v4_checkpoints(tmp_path_factory):
    """``(fp4, bf16)``: the tiny DeepSeek-V4 checkpoint pair (``_tiny.deepseek_v4_checkpoints``),
    written once per session."""
    import _tiny

    return _tiny.deepseek_v4_checkpoints(tmp_path_factory.mktemp("v4"))


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of world size 1 in this process for one test (transformers'
    Mega-MoE needs an EP group), destroyed after it with the buffers cached over it."""
    import _ep

    with _ep.one_rank_world(tmp_path):
        yield
