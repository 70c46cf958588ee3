"""The wire quantizer's state: its amax, where that amax came from, and its mode.

:class:`QuantizerState` is the base of :class:`~moewire.quantizer.WireQuantizer`. It holds
the state ModelOpt's ``TensorQuantizer`` holds for one format:

- ``amax``: a registered FP32 ``[]`` buffer, so ``state_dict``, ``.to(device)`` and CUDA
  graphs see it. It is only ever updated in place (``copy_``, ``torch.maximum(out=)``), so
  a captured graph keeps reading the live value. ``has_amax`` says whether it holds a
  calibrated, constant or loaded value (``amax_source``).
- the calibration state: the running max of ``|x|`` (``calib_amax``), whether any row was
  seen (``calib_seen``) and how many NaN values were skipped (``calib_nan``); buffers too,
  but not saved in the ``state_dict``. What fills them is in
  :mod:`moewire.quantizer.calibrate`.
- ``mode``: ``"quantize"``, ``"calibrate"`` (values pass through unquantized, ModelOpt's
  semantics, while ``collect`` keeps the running max) or ``"disabled"``.

A fixed amax is set here, on the host, with its checks: :meth:`~QuantizerState.set_constant_amax`
and :meth:`~QuantizerState.load_amax`.

May import: torch, ``moewire.formats`` and the package's own ``config``; nothing else of
moewire.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from moewire import formats
from moewire.formats.base import amax_is_valid
from moewire.quantizer.config import CfgError, positive_amax

MODES = ("quantize", "calibrate", "disabled")

_State = TypeVar("_State", bound="QuantizerState")


def host_amax(value: torch.Tensor | float, what: str) -> torch.Tensor:
    """``value`` as FP32 ``[]`` on the CPU, refused unless it is one finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (torch.Tensor, numbers.Real)):
        raise TypeError(f"{what}: amax must be a number or a one-element tensor, got "
                        f"{type(value).__name__}")
    tensor = torch.as_tensor(value).detach()
    if tensor.numel() != 1:
        raise ValueError(f"{what}: amax must be one value, got shape {tuple(tensor.shape)}")
    tensor = tensor.to("cpu", torch.float32).reshape(())
    if not amax_is_valid(float(tensor)):
        raise ValueError(f"{what}: amax is {float(tensor)}; it must be finite and >= 0")
    return tensor


class QuantizerState(nn.Module):
    """The amax and calibration buffers, the amax's source and the mode of one format.

    Args:
        fmt: the format the state is kept for (already resolved).
        enable: ``False`` starts in ``"disabled"`` mode.
        name: the quantizer's path in the model, used in messages (``None``: its class).
    """

    amax: torch.Tensor
    calib_amax: torch.Tensor
    calib_seen: torch.Tensor
    calib_nan: torch.Tensor

    def __init__(self, fmt: formats.WireFormat, *, enable: bool, name: str | None) -> None:
        super().__init__()
        self.fmt = fmt
        self.name = name
        self.register_buffer("amax", torch.zeros((), dtype=torch.float32))
        self.register_buffer("calib_amax", torch.zeros((), dtype=torch.float32),
                             persistent=False)
        self.register_buffer("calib_seen", torch.zeros((), dtype=torch.bool), persistent=False)
        self.register_buffer("calib_nan", torch.zeros((), dtype=torch.int64), persistent=False)
        self.has_amax = False
        self.amax_source: str | None = None
        self.constant_amax: float | None = None
        self._mode = "quantize" if enable else "disabled"
        self._mode_before_calibration = self._mode

    # -- mode --------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"quantize"``, ``"calibrate"`` or ``"disabled"``."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"{self._label()}: mode {value!r} is not one of {MODES}")
        self._mode = value

    @property
    def enabled(self) -> bool:
        """Whether the quantizer does anything (``mode != "disabled"``)."""
        return self._mode != "disabled"

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._mode = "quantize" if value else "disabled"

    def enable(self) -> None:
        """Switch to ``"quantize"`` mode."""
        self._mode = "quantize"

    def disable(self) -> None:
        """Switch to ``"disabled"`` mode (values pass through)."""
        self._mode = "disabled"

    # -- the amax ------------------------------------------------------------------------

    @property
    def static_amax(self) -> torch.Tensor | None:
        """The FP32 ``[]`` device tensor the scale uses, or ``None`` when none is fixed."""
        return self.amax if self.has_amax else None

    def set_constant_amax(self, value: float) -> None:
        """Fix the amax to ``value`` (finite, > 0); calibration will not change it."""
        if not self.fmt.needs_amax:
            raise ValueError(
                f"{self._label()}: format {self.fmt.name!r} has no global amax (its scales "
                "come from each block or row); constant_amax does not apply, remove it"
            )
        try:
            value = positive_amax(value, ("constant_amax",))
        except CfgError as err:
            raise ValueError(f"{self._label()}: {err}") from None
        self.amax.fill_(value)
        self.constant_amax = float(self.amax.cpu())
        self.has_amax = True
        self.amax_source = "constant"

    def load_amax(self, amax: torch.Tensor | float) -> None:
        """Set the amax to a saved value (a ModelOpt checkpoint, ``load_scales``).

        Args:
            amax: one finite value >= 0 (0 is taken as given: ModelOpt saves it for a
                quantizer that saw only zeros, and the formats have a fallback for it).

        Raises:
            ValueError: not one finite value >= 0, or it differs from ``constant_amax``.
        """
        value = host_amax(amax, self._label())
        if self.constant_amax is not None and float(value) != self.constant_amax:
            raise ValueError(
                f"{self._label()}: has constant_amax={self.constant_amax} and the loaded amax "
                f"is {float(value)}; build the quantizer without constant_amax to load it"
            )
        self.amax.copy_(value)
        self.has_amax = True
        if self.amax_source != "constant":
            self.amax_source = "loaded"

    def _apply(self: _State, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> _State:
        # model.to(torch.bfloat16) must move the state, never round the amax.
        before = dict(self._buffers)
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        for key, old in before.items():
            new = self._buffers[key]
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[key] = old.to(new.device)
        return self

    def _label(self) -> str:
        return self.name or f"WireQuantizer({self.fmt.name})"
