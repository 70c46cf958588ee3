"""The contract a wire quantizer keeps, and moewire's one calibration over many quantizers
and ranks (one quantizer's own calibration steps are ``calibrate.py``'s).

:class:`WireQuantizerLike` is what ``megamoe``, the API and the integrations call on a
dispatch or combine quantizer; ``moewire.quantizer.WireQuantizer`` and ModelOpt's
``moewire.integrations.modelopt.WireTensorQuantizer`` implement it. :func:`calibration`
drives any number of them through collect, sync across ranks (:func:`max_all_reduce`), load.
``moewire.quantizer`` re-exports all three.

May import: torch and ``moewire.formats`` (a type); nothing else of moewire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from moewire import formats

__all__ = ["WireQuantizerLike", "WireQuantizerModule", "calibration", "max_all_reduce"]


class WireQuantizerLike(Protocol):
    """The quantizer contract: what moewire calls on a dispatch or combine quantizer.

    Two classes implement it: :class:`WireQuantizer` and ModelOpt's
    ``moewire.integrations.modelopt.WireTensorQuantizer``. The Mega-MoE wrapper, the re-sum,
    ``moewire.megamoe.api`` and the integrations use these members only (plus
    ``nn.Module``'s ``buffers()`` and ``to()``: :class:`WireQuantizerModule`).
    """

    @property
    def mode(self) -> str:
        """``"quantize"``, ``"calibrate"`` (collect, pass values through) or ``"disabled"``."""

    @property
    def fmt(self) -> formats.WireFormat | None:
        """The wire format whose math runs, or ``None`` when another library's runs."""

    @property
    def static_amax(self) -> torch.Tensor | None:
        """The fixed amax (calibrated, constant or loaded), FP32 ``[]`` on the device."""

    @property
    def constant_amax(self) -> float | None:
        """The amax a cfg pinned (calibration and loading leave it), or ``None``."""

    @property
    def amax_source(self) -> str | None:
        """Where the amax came from (``"calibrated"``, ``"constant"``, ``"loaded"``), if known."""

    @property
    def calibratable(self) -> bool:
        """Whether calibration sets the amax (:func:`calibration` loads it then)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize ``x`` (quantize), collect it and return it (calibrate), or ``x``."""

    def is_static_scale(self) -> bool:
        """Whether every scale of a row depends on that row alone (the combine needs it)."""

    def collect(self, x: torch.Tensor) -> None:
        """Fold ``max|x|`` into the collected max (the caller passes valid rows only)."""

    def begin_calibration(self) -> None:
        """Forget the collected max and collect from now on (calibrate mode); no nesting."""

    def end_calibration(self) -> None:
        """Stop collecting: the mode from before :meth:`begin_calibration` comes back."""

    def sync_amax(self, group: Any) -> None:
        """Max-reduce the collected max and the fixed amax over ``group`` (every rank calls)."""

    def load_calib_amax(self) -> torch.Tensor | None:
        """The collected max becomes the amax; ``None`` (amax kept) when no data was seen."""

    def load_amax(self, amax: torch.Tensor | float) -> None:
        """Fix the amax to a saved value."""


class WireQuantizerModule(WireQuantizerLike, Protocol):
    """A wire quantizer as an experts module holds it: the contract, and the two members of
    ``nn.Module`` (both implementations are modules) the Mega-MoE wrapper uses to keep the
    quantizer's state on the data's device."""

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The state tensors (``amax`` and the calibration state)."""

    def to(self, device: torch.device) -> Any:
        """Move the state to ``device``."""


@contextlib.contextmanager
def calibration(members: Iterable[tuple[WireQuantizerLike, Sequence[Any]]]) -> Iterator[None]:
    """moewire's one calibration: collect, then sync across ranks, then load.

    Inside, every enabled quantizer collects ``max|x|`` of what it sees while values pass
    through unquantized (ModelOpt's semantics). On a normal exit, in this order:

    1. collecting stops and each quantizer's previous mode comes back;
    2. each quantizer's collected max (and fixed amax) is max-reduced over each of its
       groups in turn (``None`` entries skipped); every rank makes the same calls, also a
       rank that saw no data, which then gets the group's max instead of none;
    3. the max becomes the amax of each quantizer whose amax calibration sets
       (``calibratable``; with no data on any rank it warns and keeps its amax).

    If the body raises, the modes come back and nothing is synced or loaded. Disabled
    quantizers are left alone.

    Args:
        members: ``(quantizer, groups)`` pairs; ``groups`` are ``torch.distributed`` process
            groups (an experts module's EP group, the DP group), in the order to reduce over.

    Raises:
        RuntimeError: a quantizer is already calibrating (calibration does not nest).
    """
    active = [(q, tuple(groups)) for q, groups in members if q.mode != "disabled"]
    started: list[WireQuantizerLike] = []
    try:
        for quantizer, _ in active:
            quantizer.begin_calibration()
            started.append(quantizer)
        yield
    finally:
        for quantizer in started:
            quantizer.end_calibration()
    for quantizer, groups in active:
        for group in groups:
            if group is not None:
                quantizer.sync_amax(group)
    for quantizer, _ in active:
        if quantizer.calibratable:
            quantizer.load_calib_amax()


def max_all_reduce(group: Any, device: torch.device, *values: torch.Tensor) -> list[float] | None:
    """One ``MAX`` all-reduce of FP32 scalars over ``group``; ``None`` without a group.

    0 is neutral for a max of magnitudes, so a rank sends 0 for what it lacks. A NaN is sent
    as inf, so a bad rank makes every rank refuse the result instead of poisoning the max
    silently. ``None``: no initialised group of more than one rank (nothing to reduce).

    Args:
        group: a ``torch.distributed`` process group (``None``: the default group).
        device: where the values live (NCCL needs CUDA: CPU values are moved there).
        values: FP32 ``[]`` tensors.

    Returns:
        The reduced values, in order.
    """
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    packed = torch.stack([v.detach().float().reshape(()) for v in values]).to(device)
    packed = torch.where(torch.isnan(packed), torch.inf, packed)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return packed.tolist()
