import tempfile

import pytest


@pytest.fixture(scope="session")
def vllm_config():
    """vLLM's config context and a 1-rank gloo world, once per test process."""
    from _vllm_world import vllm_world

    with tempfile.NamedTemporaryFile() as f, vllm_world(0, 1, f.name + ".init") as config:
        yield config


@pytest.fixture(autouse=True)
def _patches_undone(request):
    """The CPU tests here (run by `make test`, on stand-ins of vLLM main's modules) quantize
    modules and drop them: their patches are undone. The `vllm` tests keep theirs (vLLM's
    plugin registers its classes once per process; the suite-wide leak check leaves them
    out)."""
    if request.node.get_closest_marker("vllm") is None:
        request.getfixturevalue("patches_undone")
    yield
