"""The real-kernel tier: DeepGEMM's SM90 Mega-MoE kernels (PR #323) on a Hopper GPU.

Every test here carries the ``real_kernel`` marker and is skipped, with the reason, where
CUDA, a Hopper GPU or the ``deep_gemm`` package with ``fp8_mega_moe`` is missing. Run it on
an H100/H200 with the package on PYTHONPATH (docs/real-kernel.md):

    pytest -m real_kernel tests/real_kernel
"""

import os
import socket

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0,
        device_id=torch.device("cuda:0"),
    )
    group = dist.new_group([0])
    yield group
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _fresh_layout_checks():
    from moewire.megamoe import layout_check

    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()
