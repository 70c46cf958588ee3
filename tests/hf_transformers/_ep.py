"""transformers' own expert parallelism on a loaded model, for a one-rank EP group.

``from_pretrained(..., distributed_config=DistributedConfig(ep_size=N))`` applies the EP plan
only for ``N > 1``; a one-rank EP group (one GPU, or the in-process CPU tests) gets the same
plan here with transformers 5.23's ``apply_expert_parallelism`` (``distributed/
expert_parallel.py``): the experts' weights become ``Shard(0)`` DTensors over the group and
their forward goes through the named ``EPImplementation``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


def apply_ep(model: torch.nn.Module, implementation: str, device: str = "cpu"):
    """Apply ``model``'s EP plan over a one-rank mesh; returns the EP group."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = init_device_mesh(device, (1,), mesh_dim_names=("ep",))
    plan = model._expand_parallel_plan(dict(model.ep_plan))
    apply_expert_parallelism(model, mesh, mesh, plan, ep_implementation=implementation)
    return mesh.get_group()


@contextlib.contextmanager
def one_rank_world(tmp: Path) -> Iterator[None]:
    """A gloo process group of world size 1 in this process, destroyed on exit with the
    Mega-MoE buffers transformers cached over it."""
    import torch.distributed as dist
    from transformers.integrations.deepgemm import destroy_megamoe_buffers

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_megamoe_buffers()
        dist.destroy_process_group()
