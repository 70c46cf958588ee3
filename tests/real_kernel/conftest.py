"""The real-kernel tier: DeepGEMM's SM90 Mega-MoE kernels (PR #323) on a Hopper GPU.

Every test here carries the ``real_kernel`` marker and is skipped, with the reason, where
CUDA, a Hopper GPU or the ``deep_gemm`` package with ``fp8_mega_moe`` is missing. Run it on
an H100/H200 with the package on PYTHONPATH (docs/real-kernel.md):

    pytest -m real_kernel tests/real_kernel
"""

import pytest


def pytest_collection_modifyitems(config, items):
    from moewire.integrations import deepgemm_sm90

    ok, why = deepgemm_sm90.available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"real SM90 Mega-MoE kernel unavailable: {why}")
    for item in items:
        if item.get_closest_marker("real_kernel") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ep_group():
    """A one-rank NCCL group (the SM90 buffer is torch symmetric memory over a group)."""
    import torch.distributed as dist
    from rk_cases import one_rank_group

    group = one_rank_group()
    yield group
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _fresh_layout_checks():
    from moewire.megamoe import layout_check

    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


@pytest.fixture(autouse=True)
def _patches_undone(request):
    """The CPU tests here quantize user modules and drop them: their patches are undone.
    The real-kernel tests keep theirs (their module-scoped layers live across tests, and
    the suite-wide leak check leaves them out)."""
    if request.node.get_closest_marker("real_kernel") is None:
        request.getfixturevalue("patches_undone")
    yield
