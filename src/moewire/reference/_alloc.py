"""Buffer plumbing shared by the stand-in's two buffers (``buffer.SymmBuffer`` and
``nvfp4.buffer.NVFP4SymmBuffer``): sizes and their checks, the rank of a group, where a
buffer lives and how it is allocated.

May import: torch only (nothing of moewire), so every reference module can use it.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.distributed as dist


def align(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return (x + y - 1) // y * y


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def positive_int(value: Any, name: str, where: str, minimum: int = 1) -> int:
    """``value``, checked to be an int (not a bool) ``>= minimum``.

    Raises:
        ValueError: it is not (``where`` names the call, ``name`` the argument).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def check_buffer_sizes(where: str, **sizes: int) -> None:
    """Each of ``sizes`` (a buffer's ``num_experts``, ``num_max_tokens_per_rank``, ...)
    checked by :func:`positive_int`, in the order given; ``num_shared_experts`` may be 0."""
    for name, value in sizes.items():
        positive_int(value, name, where, minimum=0 if name == "num_shared_experts" else 1)


def fail(where: str, message: str, exc: type[Exception] = ValueError) -> NoReturn:
    """Raise ``exc`` with ``where`` (the call) naming the layer: ``"{where}: {message}"``."""
    raise exc(f"{where}: {message}")


def check_split(where: str, num_experts: int, num_ranks: int, num_topk: int,
                num_shared_experts: int | None = None) -> None:
    """The routing sizes every buffer checks: experts split evenly over the ranks, top-k
    within the experts and, with ``num_shared_experts`` given, the ``k`` slots (+1 for a
    fused shared expert) within one warp (32).

    Raises:
        ValueError: one of them does not hold (the message names ``where``).
    """
    if num_experts % num_ranks:
        fail(where, f"num_experts={num_experts} is not divisible by the group size "
                    f"{num_ranks}; experts are split evenly over the ranks")
    if num_topk > num_experts:
        fail(where, f"num_topk={num_topk} exceeds num_experts={num_experts}")
    if num_shared_experts is not None and num_topk + (num_shared_experts > 0) > 32:
        fail(where, f"num_topk={num_topk} (+1 fused shared slot) must fit one warp (32)")


def group_size_rank(group: Any, where: str) -> tuple[int, int]:
    """``(world size, rank)`` of an EP group; ``None`` is one rank.

    Raises:
        TypeError: ``group`` is neither ``None`` nor a ProcessGroup (``where`` names the call).
    """
    if group is None:
        return 1, 0
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{where}: group must be a torch.distributed.ProcessGroup or None (one rank), got "
            f"{type(group).__name__}"
        )
    return group.size(), group.rank()


def default_device(group: Any) -> torch.device:
    """The current CUDA device for one rank or an NCCL group, else the CPU."""
    backend = None if group is None else dist.get_backend(group)
    if torch.cuda.is_available() and backend in (None, "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allocate(num_bytes: int, device: torch.device, group: Any, num_ranks: int):
    """A flat int8 buffer and its symmetric-memory handle: symmetric memory on CUDA with
    several ranks when torch has it, else a plain tensor (handle ``None``)."""
    if num_ranks > 1 and device.type == "cuda":
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(num_bytes, dtype=torch.int8, device=device)
            return buffer, symm_mem.rendezvous(buffer, group=group)
        except Exception:  # any failure (no CUDA IPC, old torch) means: a plain tensor
            pass
    return torch.empty(num_bytes, dtype=torch.int8, device=device), None
