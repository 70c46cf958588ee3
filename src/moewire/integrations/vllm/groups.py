"""vLLM's process groups as moewire reads them: the EP group of the Mega-MoE layers and
the data-parallel group.

A module of its own below both users: the package's ``__init__`` (the adapters' ``ep_group``, the
per-rank scales path, the calibration RPCs) and ``worker.py`` (one-launch
calibration, which shards its sequences over DP). Read at call time from
``vllm.distributed.parallel_state``: vLLM builds the groups after the plugin loads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["data_parallel", "dp_device_group", "ep_device_group", "ep_rank"]


def ep_device_group() -> Any:
    """vLLM's EP device group, or ``None`` with no EP group or one of a single rank (no
    reduce to do)."""
    from vllm.distributed import parallel_state

    if parallel_state._EP is None:
        return None
    group = parallel_state.get_ep_group()
    return group.device_group if group.world_size > 1 else None


def dp_device_group() -> Any:
    """vLLM's data-parallel device group, or ``None`` with no DP group or one of a single
    rank (the group of a site whose experts are replicated over DP, not sharded over EP)."""
    from vllm.distributed import parallel_state

    if parallel_state._DP is None:
        return None
    group = parallel_state.get_dp_group()
    return group.device_group if group.world_size > 1 else None


def data_parallel() -> tuple[Any, int, int]:
    """vLLM's data-parallel group: ``(device group or None for one rank, size, rank)``."""
    from vllm.distributed import parallel_state

    dp = parallel_state.get_dp_group()
    group = dp.device_group if dp.world_size > 1 else None
    return group, dp.world_size, dp.rank_in_group


def ep_rank() -> int:
    """This process's rank in vLLM's EP group (0 without EP): the ``{rank}`` of a scales
    path (``moewire.integrations._host.rank_path``)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_ep_group().rank_in_group if parallel_state._EP is not None else 0
