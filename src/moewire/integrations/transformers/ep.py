"""Expert parallelism of transformers for moewire's experts: the ``"moewire"`` EP
implementation, the groups calibration reduces over, and one scales file for every rank.

transformers 5.23.0 (``transformers/distributed/expert_parallel.py``) shards the experts of
an ``ep_dispatch_experts`` module over the EP mesh (``MoEParamShard``: each rank keeps
``E / ep`` experts, ``module.num_experts`` becomes the local count) and reaches them through
the ``EPImplementation`` that ``DistributedConfig.ep_implementation`` names in
``EPImplementationInterface``. ``"auto"`` picks ``AllReduceEP`` for every experts
implementation but ``"deepgemm_megamoe"``: it hands each rank's experts local ids with the
other ranks' routes masked, which is not what a Mega-MoE kernel takes (global ids; the kernel
exchanges the tokens). So :func:`register` adds ``"moewire"`` to that registry, bound to
transformers' own ``MegaMoeEP``, unmodified: the ``"moewire"`` experts run under EP exactly
as ``"deepgemm_megamoe"`` does. Example, 4 tokens on 2 ranks, 4 experts, top-2:

    GPU                      0                          1
                             |                          |
    batch             [t0, t1, t2, t3]           [t0, t1, t2, t3]     the same tokens on both
    experts held          E0  E1                     E2  E3           MoEParamShard, Shard(0)
    kernel input          [t0, t1]                   [t2, t3]         rows r*2 .. r*2+1
    top_k_index           [[0, 2], [1, 3]]           [[3, 0], [2, 1]] global ids, unmasked
    staged in the buffer  x, ids, weights of t0, t1  ... of t2, t3
    the kernel            t0's slot 1 and t1's slot 1 go to rank 1, t2's slot 1 and t3's
                          slot 1 come to rank 0; each expert's row returns to its token's
                          rank, which sums its tokens' rows in slot order
    kernel output         [y0, y1]                   [y2, y3]
    after all-gather             [y0, y1, y2, y3] on both ranks

With an odd count (3 tokens on 2 ranks) rank 1's slice is ``[t2, pad]``: the padding row is
zeros with ids ``-1`` and weight 0, a token with no valid slot, which the kernel never
dispatches and moewire keeps out of the dispatch amax, the combine amax and the re-sum.

Launch with ``torchrun --nproc-per-node N`` and ``from_pretrained(path,
experts_implementation="moewire", distributed_config=DistributedConfig(tp_size=N,
ep_size=N, ep_implementation="moewire"))``: ``MegaMoeEP`` needs every rank of the EP group
to hold the same batch (``ep_size == tp_size``). ``prepare(model)`` then builds every experts
module's buffer on the EP group (:func:`mesh_groups`), for ``E`` experts over the group.

Calibration reduces every amax over the EP group and then over the ranks that hold the same
experts with other batches (the expert mesh's ``dp_replicate`` and ``efsdp`` dimensions,
where transformers has them), so every rank ends with the same scales; :func:`ranks_agree`
checks it and ``moewire.integrations.transformers.save_scales`` writes one file from rank 0.

May import: the standard library, torch and ``moewire.megamoe`` (transformers at call time).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moewire.megamoe.api import quantizers

__all__ = ["IMPLEMENTATION", "mesh_groups", "ranks_agree", "register", "unregister"]

#: The name of moewire's EP implementation in transformers' ``EPImplementationInterface``.
IMPLEMENTATION = "moewire"
#: transformers' EP implementation it runs (``distributed/expert_parallel.py``).
RUNS = "MegaMoeEP"
# The dimensions of transformers' expert mesh (``TransformersDeviceMesh``) that hold the same
# experts with other batches, and the DistributedConfig sizes of each.
_DP_DIMS = (("dp_replicate", "dp_replicate_size"), ("efsdp", "efsdp_size"))


def _interface() -> Any:
    from transformers.distributed import expert_parallel

    return expert_parallel.EPImplementationInterface


def register() -> None:
    """Add ``"moewire"`` to ``EPImplementationInterface``, bound to ``MegaMoeEP``."""
    from transformers.distributed import expert_parallel

    _interface().register(IMPLEMENTATION, getattr(expert_parallel, RUNS))


def unregister() -> None:
    """Undo :func:`register`."""
    _interface()._global_mapping.pop(IMPLEMENTATION, None)


def mesh_groups(model: nn.Module) -> tuple[Any, tuple[Any, ...]]:
    """``(EP group, DP groups)`` of a model transformers distributed with ``ep_size > 1``.

    transformers 5.23's ``maybe_distribute_model`` keeps the meshes in ``model._mesh_manager``
    (a ``TransformersDeviceMesh``) and the config in ``model.config.distributed_config``.

    Returns:
        The EP group and the groups of the ``dp_replicate`` and ``efsdp`` dimensions that
        have more than one rank; ``(None, ())`` for a model without expert parallelism.
    """
    manager = getattr(model, "_mesh_manager", None)
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if manager is None or config is None or getattr(config, "ep_size", 1) <= 1:
        return None, ()
    dp = tuple(manager.get_mesh(dim).get_group() for dim, size in _DP_DIMS
               if getattr(config, size, 1) > 1)
    return manager.get_mesh("ep").get_group(), dp


def _amaxes(model: nn.Module) -> torch.Tensor:
    """Every quantizer's fixed amax in module order, FP32 on the CPU (NaN for none)."""
    values = []
    for _, _, quantizer in quantizers(model):
        amax = quantizer.static_amax
        values.append(float("nan") if amax is None else float(amax))
    return torch.tensor(values, dtype=torch.float32)


def ranks_agree(model: nn.Module) -> list[str]:
    """The quantizers whose amax differs between the ranks of the default process group
    (empty when every rank holds the same scales, or without a process group).

    Every rank calls it (one all-gather).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    mine = _amaxes(model)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    local = mine.to(device) if device is not None else mine
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    table = torch.stack([g.cpu() for g in gathered])  # [ranks, quantizers]
    nan = torch.isnan(table)
    same = nan.all(dim=0) | (~nan.any(dim=0) & (table == table[0]).all(dim=0))
    names = [name for name, _, _ in quantizers(model)]
    return [name for name, ok in zip(names, same.tolist(), strict=True) if not ok]
