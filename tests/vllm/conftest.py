import tempfile

import pytest


@pytest.fixture(scope="session")
def vllm_config():
    """vLLM's config context and a 1-rank gloo world, once per test process."""
    from _vllm_world import vllm_world

    with tempfile.NamedTemporaryFile() as f, vllm_world(0, 1, f.name + ".init") as config:
        yield config
