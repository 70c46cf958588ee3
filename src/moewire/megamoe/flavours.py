"""Kernel build flavours: where a build puts the combine region and its fused shared slot.

A flavour is a property of the DeepGEMM build, not of the model (SPEC 1.2, 1.3):

- ``upstream``: the combine region is the buffer's last region; no fused shared expert.
- ``vllm`` (vLLM's vendored DeepGEMM): the upstream layout; a fused shared expert owns
  slot ``k`` and is added last, after the routed slots.
- ``sgl`` (sgl-deep-gemm 0.2.5): small regions follow the combine region, whose base is the
  end of the ``l2_acts_sf`` view (of ``l2_acts`` without scales); a fused shared expert owns
  slot 0 (routed slot ``s`` lives at ``s + 1``) and is added first.

Both base rules agree on an upstream build. A rule is only trusted once the layout check
(``moewire.megamoe.wrapper``) has reproduced the kernel output bit for bit with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BASE_RULES", "Flavour", "get", "names", "register", "register_base_rule"]

SHARED_SLOTS = (None, "first", "last")


def _flat_buffer(symm_buffer: Any, flavour: str) -> torch.Tensor:
    buffer = getattr(symm_buffer, "buffer", None)
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype != torch.int8:
        raise ValueError(
            f"flavour {flavour!r}: the symmetric buffer must have a flat int8 tensor in "
            f"`.buffer`, got {type(buffer).__name__}"
            + (f" {buffer.dtype} {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) else "")
        )
    return buffer


def _base_last_region(symm_buffer: Any, combine_bytes: int, flavour: str) -> int:
    """Upstream rule: the combine region ends where the buffer ends."""
    return _flat_buffer(symm_buffer, flavour).numel() - combine_bytes


def _base_after_l2_acts_sf(symm_buffer: Any, combine_bytes: int, flavour: str) -> int:
    """Fork rule: the combine region starts where ``l2_acts_sf`` (else ``l2_acts``) ends.

    A ``bf16xbf16`` buffer has an empty ``l2_acts_sf`` view; its end is then the end of
    ``l2_acts``, which is where the empty view starts in any case.
    """
    flat = _flat_buffer(symm_buffer, flavour)
    view = getattr(symm_buffer, "l2_acts_sf", None)
    if not isinstance(view, torch.Tensor) or view.numel() == 0:
        view = getattr(symm_buffer, "l2_acts", None)
    if not isinstance(view, torch.Tensor):
        raise ValueError(
            f"flavour {flavour!r}: its combine base is the end of the buffer's `l2_acts_sf` "
            "(or `l2_acts`) view, and the buffer has neither; use a flavour whose rule fits "
            "this build"
        )
    if view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        raise ValueError(
            f"flavour {flavour!r}: the buffer's `l2_acts_sf` view does not share storage with "
            "`.buffer`, so it cannot locate the combine region"
        )
    start = view.storage_offset() * view.element_size() - flat.storage_offset()
    return start + view.numel() * view.element_size()


BaseRule = Callable[[Any, int, str], int]

BASE_RULES: dict[str, BaseRule] = {
    "last_region": _base_last_region,
    "after_l2_acts_sf": _base_after_l2_acts_sf,
}


def register_base_rule(name: str, rule: BaseRule) -> None:
    """Register a combine-base rule ``rule(symm_buffer, combine_bytes, flavour) -> offset``.

    The offset is in bytes from the start of ``symm_buffer.buffer``.
    """
    if name in BASE_RULES:
        raise ValueError(f"combine base rule {name!r} is already registered")
    BASE_RULES[name] = rule


@dataclass(frozen=True)
class Flavour:
    """One kernel build's combine layout.

    Attributes:
        name: registry name (``"vllm"``).
        combine_base_rule: name of a rule in :data:`BASE_RULES` giving the byte offset of
            the combine region in ``symm_buffer.buffer``.
        shared_slot: a fused shared expert's slot and place in the sum: ``"last"`` (slot
            ``k``, added after the routed slots), ``"first"`` (slot 0, added first, routed slot
            ``s`` at ``s + 1``) or ``None`` (this build fuses no shared expert).
    """

    name: str
    combine_base_rule: str
    shared_slot: str | None

    def __post_init__(self) -> None:
        if self.combine_base_rule not in BASE_RULES:
            raise ValueError(
                f"flavour {self.name!r}: unknown combine base rule {self.combine_base_rule!r}; "
                f"known rules: {sorted(BASE_RULES)} (add one with register_base_rule)"
            )
        if self.shared_slot not in SHARED_SLOTS:
            raise ValueError(
                f"flavour {self.name!r}: shared_slot must be one of {SHARED_SLOTS}, got "
                f"{self.shared_slot!r}"
            )

    def combine_base(self, symm_buffer: Any, combine_bytes: int) -> int:
        """Byte offset of the combine region (``combine_bytes`` long) in the flat buffer."""
        return BASE_RULES[self.combine_base_rule](symm_buffer, combine_bytes, self.name)


_REGISTRY: dict[str, Flavour] = {}


def register(flavour: Flavour) -> Flavour:
    """Register ``flavour`` under its name; a name is registered once."""
    if not isinstance(flavour, Flavour):
        raise TypeError(f"register: expected a Flavour, got {type(flavour).__name__}")
    if flavour.name in _REGISTRY:
        raise ValueError(f"kernel flavour {flavour.name!r} is already registered")
    _REGISTRY[flavour.name] = flavour
    return flavour


def get(name: str | Flavour) -> Flavour:
    """The registered flavour called ``name`` (a :class:`Flavour` is returned as is)."""
    if isinstance(name, Flavour):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown kernel flavour {name!r}; known flavours: {', '.join(names())}"
        ) from None


def names() -> list[str]:
    """Names of every registered flavour, sorted."""
    return sorted(_REGISTRY)


register(Flavour("upstream", "last_region", None))
register(Flavour("vllm", "last_region", "last"))
register(Flavour("sgl", "after_l2_acts_sf", "first"))
