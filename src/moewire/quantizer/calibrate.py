"""The wire quantizer's calibration: collect the max of ``|x|``, sync it, load it as amax.

:class:`QuantizerCalibration` adds to :class:`~moewire.quantizer.state.QuantizerState` the
steps :func:`moewire.quantizer.contract.calibration` drives (the one calibration every path
uses: collect, then sync across ranks, then load): :meth:`~QuantizerCalibration.collect`,
:meth:`~QuantizerCalibration.begin_calibration` / ``end_calibration``,
:meth:`~QuantizerCalibration.sync_amax`, :meth:`~QuantizerCalibration.load_calib_amax`, and
:meth:`~QuantizerCalibration.calibrating` for one quantizer alone.

NaN during calibration: ModelOpt's ``MaxCalibrator`` asserts (a host sync) when a
collected amax is NaN or inf. moewire cannot read values while collecting, so
``collect`` skips NaN elements (a NaN never turns a finite max into NaN) and counts them;
``load_calib_amax`` then warns with the count. An inf is kept in the max, and
``load_calib_amax`` refuses it.

May import: torch and the package's own ``contract`` and ``state``; nothing else of moewire.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar, cast

import torch

from moewire.quantizer.contract import WireQuantizerLike, calibration, max_all_reduce
from moewire.quantizer.state import QuantizerState

_Calibrated = TypeVar("_Calibrated", bound="QuantizerCalibration")


class QuantizerCalibration(QuantizerState):
    """The calibration steps of a wire quantizer (see :func:`~.contract.calibration`)."""

    @torch.no_grad()
    def collect(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Fold ``max|x|`` over the valid elements into the running max; no host sync.

        ``calib_amax = max(calib_amax, max{|x[i]| : valid[i], x[i] not NaN})`` in FP32
        (exact: ``|x|`` of BF16/FP16/FP32 is exact in FP32); ``calib_seen |= any(valid)``;
        ``calib_nan += #{i : valid[i], x[i] is NaN}``. An inf is kept (and refused later).

        Args:
            x: BF16/FP16/FP32, any shape, on the quantizer's device.
            valid: optional bool mask broadcastable to ``x.shape`` (e.g. ``[..., 1]``, one
                flag per row): only these elements count, and a call whose mask is all
                False counts as no data. ``None``: every element of ``x`` counts.

        Raises:
            ValueError/TypeError: ``valid`` does not broadcast to ``x`` or is not bool.
            RuntimeError: ``x`` is on another device than the quantizer's state.
        """
        if x.device != self.calib_amax.device:
            raise RuntimeError(
                f"{self._label()}: x is on {x.device} and the calibration state on "
                f"{self.calib_amax.device}; move the quantizer first (q.to(x.device))"
            )
        if valid is not None:
            if valid.dtype != torch.bool:
                raise TypeError(f"{self._label()}: valid must be a bool mask, got {valid.dtype}")
            try:
                broadcast = torch.broadcast_shapes(valid.shape, x.shape)
            except RuntimeError:
                broadcast = None
            if broadcast != x.shape:
                raise ValueError(
                    f"{self._label()}: valid has shape {tuple(valid.shape)}, which does not "
                    f"broadcast to x's {tuple(x.shape)}; give one flag per row as [..., 1]"
                )
        if x.numel() == 0:
            return
        magnitude = x.detach().abs()
        nan = torch.isnan(magnitude)
        keep = ~nan if valid is None else valid & ~nan
        if valid is not None:
            nan = nan & valid
        kept = torch.where(keep, magnitude, torch.zeros((), dtype=x.dtype, device=x.device))
        torch.maximum(self.calib_amax, kept.amax().float(), out=self.calib_amax)
        self.calib_nan.add_(nan.sum())
        if valid is None:
            self.calib_seen.fill_(True)
        else:
            self.calib_seen.logical_or_(valid.any())

    def reset_calibration(self) -> None:
        """Forget the collected max (in place); the amax is kept."""
        self.calib_amax.zero_()
        self.calib_seen.zero_()
        self.calib_nan.zero_()

    @property
    def calibratable(self) -> bool:
        """Whether calibration sets the amax: a global-amax format without ``constant_amax``."""
        return self.fmt.needs_amax and self.constant_amax is None

    def begin_calibration(self) -> None:
        """Reset the collected state and switch to calibrate mode (see :func:`calibration`).

        Raises:
            RuntimeError: already calibrating (calibration does not nest).
        """
        if self._mode == "calibrate":
            raise RuntimeError(
                f"{self._label()}: already calibrating; calibrating() does not nest"
            )
        self._mode_before_calibration = self._mode
        self.reset_calibration()
        self._mode = "calibrate"

    def end_calibration(self) -> None:
        """Leave calibrate mode: the mode from before :meth:`begin_calibration` comes back."""
        self._mode = self._mode_before_calibration

    @contextlib.contextmanager
    def calibrating(self: _Calibrated) -> Iterator[_Calibrated]:
        """Calibrate mode inside (values pass through), then :meth:`load_calib_amax`.

        :func:`calibration` for this quantizer alone (no process group): a disabled
        quantizer stays disabled and collects nothing; the collected state is reset on
        entry; on a normal exit the previous mode comes back and, for a format with a global
        amax and no ``constant_amax``, the max is loaded (with no data seen it warns and
        keeps the quantizer as it was). If the body raises, the mode comes back and nothing
        is loaded.

        Raises:
            RuntimeError: already calibrating (calibration does not nest).
        """
        # The whole quantizer (binding.WireQuantizer) keeps the contract; this layer alone
        # lacks the format's members (fmt, __call__, is_static_scale).
        with calibration([(cast(WireQuantizerLike, self), ())]):
            yield self

    def load_calib_amax(self) -> torch.Tensor | None:
        """Finish calibration: copy the collected max into ``amax`` (host-side checks).

        Returns:
            The ``amax`` buffer, or ``None`` when no data was seen (a warning then says so
            and what to do; ``has_amax`` is left as it was).

        Raises:
            RuntimeError: the quantizer has a ``constant_amax``.
            ValueError: data was seen and the max is 0 (all values 0 or NaN), inf or NaN.
        """
        label = self._label()
        if self.constant_amax is not None:
            raise RuntimeError(
                f"{label}: has constant_amax={self.constant_amax}, which calibration does not "
                "change; build it without constant_amax to calibrate"
            )
        seen, value, nan = bool(self.calib_seen), float(self.calib_amax), int(self.calib_nan)
        if not seen:
            state = (f"it keeps its {self.amax_source} amax" if self.has_amax
                     else "it keeps no amax")
            warnings.warn(
                f"{label}: calibration saw no data, so {state}. Run forward passes with "
                "routed tokens inside calibrating(), or call sync_amax(group) to take the "
                "max of the ranks that saw data, or set constant_amax",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        skipped = f" ({nan} NaN values were skipped)" if nan else ""
        if not math.isfinite(value) or value == 0:
            cause = ("every collected value was 0 or NaN" if value == 0
                     else "the collected data held inf" if math.isinf(value)
                     else "the collected max is NaN (a corrupted or synced state)")
            raise ValueError(
                f"{label}: refusing calibrated amax={value}: {cause}{skipped}. Calibrate on "
                "real activations (rows with routed tokens), or set constant_amax"
            )
        if nan:
            warnings.warn(
                f"{label}: calibration skipped {nan} NaN values; amax={value:.4e} is the max "
                "of the finite ones. Check the model for NaN activations",
                RuntimeWarning,
                stacklevel=2,
            )
        self.amax.copy_(self.calib_amax)
        self.has_amax = True
        self.amax_source = "calibrated"
        return self.amax

    # -- distributed ---------------------------------------------------------------------

    def sync_amax(self, group: Any = None) -> None:
        """Max-all-reduce the amax and the calibration state over a process group.

        Every rank must call it (exactly one collective per call, whatever its state). One
        FP32 ``[4]`` tensor ``[amax if has_amax else 0, has_amax, calib_amax, calib_seen]``
        is reduced with ``MAX`` (:func:`max_all_reduce`): a rank that saw no data neither
        hangs nor lowers the result, the flags become "any rank", and a NaN (sent as inf)
        makes every rank refuse in :meth:`load_calib_amax`. :func:`calibration` calls it
        before :meth:`load_calib_amax`; after it works too. No-op without an initialised
        group of > 1 ranks.

        Args:
            group: a ``torch.distributed`` process group (``None``: the default group).

        Raises:
            RuntimeError: (after the collective) ranks disagree on ``constant_amax``.
        """
        zero = torch.zeros((), dtype=torch.float32, device=self.amax.device)
        reduced = max_all_reduce(
            group, self.amax.device, self.amax if self.has_amax else zero,
            zero + self.has_amax, self.calib_amax, self.calib_seen.float(),
        )
        if reduced is None:
            return
        amax, any_amax, calib, any_seen = reduced
        self.calib_amax.fill_(calib)
        self.calib_seen.fill_(any_seen > 0)
        if not any_amax:
            return
        if self.constant_amax is not None and amax != self.constant_amax:
            raise RuntimeError(
                f"{self._label()}: constant_amax={self.constant_amax} here, but another rank "
                f"holds amax={amax}; build every rank's quantizer from the same recipe"
            )
        self.amax.fill_(amax)
        self.has_amax = True
        self.amax_source = self.amax_source or "calibrated"
