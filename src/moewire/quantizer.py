"""The wire quantizer: one format plus its calibration state (amax, enable, mode).

A :class:`WireQuantizer` is what the Mega-MoE wrapper puts on the dispatch and the combine
path. It holds a :class:`~moewire.formats.WireFormat` and the state ModelOpt's
``TensorQuantizer`` holds for it:

- ``amax``: a registered FP32 ``[]`` buffer, so ``state_dict``, ``.to(device)`` and CUDA
  graphs see it. It is only ever updated in place (``copy_``, ``torch.maximum(out=)``), so
  a captured graph keeps reading the live value. ``has_amax`` says whether it holds a
  calibrated, constant or loaded value (``amax_source``).
- the calibration state: the running max of ``|x|`` (``calib_amax``), whether any row was
  seen (``calib_seen``) and how many NaN values were skipped (``calib_nan``); buffers too,
  but not saved in the ``state_dict``.
- ``mode``: ``"quantize"``, ``"calibrate"`` (values pass through unquantized, ModelOpt's
  semantics, while :meth:`~WireQuantizer.collect` keeps the running max) or
  ``"disabled"``.

``forward`` and ``collect`` never synchronise with the host (no ``.item()``, no Python
branch on a tensor value), so both can be captured in a CUDA graph; every check that has
to read a value runs on the host in :meth:`~WireQuantizer.load_calib_amax`,
:meth:`~WireQuantizer.load_amax` and :meth:`~WireQuantizer.sync_amax`.

NaN during calibration: ModelOpt's ``MaxCalibrator`` asserts (a host sync) when a
collected amax is NaN or inf. moewire cannot read values while collecting, so
``collect`` skips NaN elements (a NaN never turns a finite max into NaN) and counts them;
``load_calib_amax`` then warns with the count. An inf is kept in the max, and
``load_calib_amax`` refuses it.

What callers may use is written down once, as the Protocol
:class:`~moewire.calibration.WireQuantizerLike` (ModelOpt's ``WireTensorQuantizer``
implements it too), and every calibration runs through
:func:`~moewire.calibration.calibration`: collect, then sync across ranks, then load (both
in :mod:`moewire.calibration`, re-exported here).

ModelOpt-style configuration dicts map to formats in :mod:`moewire.config`
(:func:`~moewire.config.parse_cfg`); :meth:`WireQuantizer.from_cfg` builds the quantizer from
one. Imports ``formats``, ``config`` and ``calibration`` only.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from moewire import formats
from moewire.calibration import WireQuantizerLike, calibration, max_all_reduce

# parse_cfg and CfgError are imported from here too, as 0.1.0 documented them here.
from moewire.config import CfgError, parse_cfg, positive_amax
from moewire.formats.base import amax_is_valid

__all__ = [
    "MODES",
    "CfgError",
    "WireQuantizer",
    "WireQuantizerLike",
    "calibration",
    "max_all_reduce",
    "parse_cfg",
]

MODES = ("quantize", "calibrate", "disabled")


def _host_amax(value: torch.Tensor | float, what: str) -> torch.Tensor:
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


class WireQuantizer(nn.Module):
    """Fake-quantizes tensors in one wire format; holds the amax and calibration state.

    Args:
        fmt: a registered format name (``moewire.formats.names()``) or a format object.
        constant_amax: a fixed global amax (finite, > 0) for formats with ``needs_amax``;
            calibration then leaves it alone.
        enable: ``False`` starts in ``"disabled"`` mode (values pass through).
        allow_dynamic: for ``needs_amax`` formats without an amax, use ``max|x|`` of each
            call (ModelOpt's uncalibrated behaviour). ``False`` makes such a call an error.
        name: the quantizer's path in the model, used in messages (``None``: its class).
        accumulate: how a combine adds this quantizer's rows, ``"bf16"`` (QDQ to BF16, then
            the FP32 sum) or ``"fp32"`` (the FP32 dequantized values summed, as the real
            FP8/FP4 combine kernels do); ``None`` takes the format's
            ``combine_accumulate`` (what the real kernel for that format does).

    Attributes:
        fmt: the :class:`~moewire.formats.WireFormat`.
        amax: FP32 ``[]`` buffer; meaningful only when ``has_amax``.
        calib_amax: FP32 ``[]`` buffer, the running max of the collected ``|x|``.
        calib_seen: bool ``[]`` buffer, whether any row was collected.
        calib_nan: int64 ``[]`` buffer, NaN values skipped while collecting.
        has_amax: ``amax`` holds a fixed value; ``amax_source`` says where it came from:
            ``"calibrated"``, ``"constant"`` or ``"loaded"``.
    """

    amax: torch.Tensor
    calib_amax: torch.Tensor
    calib_seen: torch.Tensor
    calib_nan: torch.Tensor

    def __init__(
        self,
        fmt: str | formats.WireFormat = "nvfp4",
        *,
        constant_amax: float | None = None,
        enable: bool = True,
        allow_dynamic: bool = True,
        name: str | None = None,
        accumulate: str | None = None,
    ) -> None:
        super().__init__()
        label = name or "WireQuantizer"
        if not isinstance(fmt, (str, formats.WireFormat)):
            raise TypeError(f"{label}: fmt must be a format name such as 'nvfp4' or a "
                            f"WireFormat, got {type(fmt).__name__}: {fmt!r}")
        for arg, value in (("enable", enable), ("allow_dynamic", allow_dynamic)):
            # bool("no") is True: anything but a real bool would be read the wrong way.
            if not isinstance(value, bool):
                raise TypeError(f"{label}: {arg} must be True or False, got "
                                f"{type(value).__name__}: {value!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"WireQuantizer: name must be a str or None, got "
                            f"{type(name).__name__}")
        self.fmt = formats.get(fmt)
        if accumulate is not None and accumulate not in formats.ACCUMULATE_MODES:
            raise ValueError(
                f"{label}: accumulate must be one of {formats.ACCUMULATE_MODES} (or None for "
                f"the format's own, {self.fmt.combine_accumulate!r}), got {accumulate!r}"
            )
        self.accumulate = accumulate or self.fmt.combine_accumulate
        self.allow_dynamic = allow_dynamic
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
        if constant_amax is not None:
            self.set_constant_amax(constant_amax)

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any], *, name: str | None = None) -> WireQuantizer:
        """Build a quantizer from a ModelOpt-style cfg dict (:func:`moewire.config.parse_cfg`).

        Raises:
            CfgError: (``ValueError``) the cfg cannot be mapped; the message names the key.
        """
        spec = parse_cfg(cfg)
        return cls(spec.fmt, constant_amax=spec.constant_amax, enable=spec.enable,
                   allow_dynamic=spec.allow_dynamic, name=name, accumulate=spec.accumulate)

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

    # -- the scale -----------------------------------------------------------------------

    @property
    def static_amax(self) -> torch.Tensor | None:
        """The FP32 ``[]`` device tensor the scale uses, or ``None`` when none is fixed."""
        return self.amax if self.has_amax else None

    def is_static_scale(self) -> bool:
        """True when every scale of a row depends on the row alone.

        ``fmt.row_local and (not fmt.needs_amax or has_amax)``: block/row-scaled formats
        always, global-amax formats only once the amax is calibrated, constant or loaded.
        """
        return self.fmt.row_local and (not self.fmt.needs_amax or self.has_amax)

    def scale_amax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The amax the scale of ``x`` uses in quantize mode.

        Returns:
            ``None`` for formats without a global amax; the fixed ``amax`` buffer when
            ``has_amax``; else (``allow_dynamic``) ``x.abs().amax()`` of this call, FP32 ``[]``.

        Raises:
            RuntimeError: the format needs an amax, none is fixed and ``allow_dynamic`` is off.
        """
        if not self.fmt.needs_amax:
            return None
        if self.has_amax:
            return self.amax
        if self.allow_dynamic:
            if x.numel() == 0:  # no token this call: any amax gives the same empty result
                return torch.zeros((), dtype=torch.float32, device=x.device)
            return x.detach().abs().amax().float()
        raise RuntimeError(
            f"{self._label()}: format {self.fmt.name!r} needs an amax and this quantizer has "
            "none (allow_dynamic=False forbids a per-call amax); calibrate it (with "
            "q.calibrating(): run data) or set constant_amax"
        )

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
        value = _host_amax(amax, self._label())
        if self.constant_amax is not None and float(value) != self.constant_amax:
            raise ValueError(
                f"{self._label()}: has constant_amax={self.constant_amax} and the loaded amax "
                f"is {float(value)}; build the quantizer without constant_amax to load it"
            )
        self.amax.copy_(value)
        self.has_amax = True
        if self.amax_source != "constant":
            self.amax_source = "loaded"

    # -- forward and calibration -----------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fmt.qdq(x, scale_amax(x))`` (quantize); collect, return ``x`` (calibrate); ``x``.

        Args:
            x: BF16/FP16/FP32 ``[..., H]``.

        Returns:
            ``x.dtype``, ``x.shape`` (``x`` itself when calibrating or disabled).
        """
        if self._mode == "quantize":
            amax = self.scale_amax(x)
            try:
                return self.fmt.qdq(x, amax)
            except ValueError as err:
                if amax is None or self.has_amax:
                    raise
                # The format read a NaN/inf per-call amax (it does on the host): no
                # calibration ran, so the cause is the input, not calibration data.
                raise ValueError(
                    f"{self._label()}: the per-call amax (max|x| of this call: the quantizer "
                    "has no calibrated, constant or loaded amax) is not finite because x "
                    "holds NaN or inf; fix the input (the layer before produced it), or "
                    f"calibrate the quantizer / set constant_amax ({err})"
                ) from None
        if self._mode == "calibrate":
            self.collect(x)
        return x

    def dequantize(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`, returning the FP32 values before the cast to ``x.dtype``.

        In quantize mode the format's FP32 dequantized values (``fmt.dequantize``: what a
        combine with ``accumulate="fp32"`` adds); otherwise ``x`` widened to FP32 (after
        collecting it when calibrating).

        Args:
            x: BF16/FP16/FP32 ``[..., H]``.

        Returns:
            FP32, ``x.shape``.
        """
        if self._mode == "quantize":
            return self.forward(x.float())
        return self.forward(x).float()

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
    def calibrating(self) -> Iterator[WireQuantizer]:
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
        with calibration([(self, ())]):
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

    # -- state -------------------------------------------------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": self.fmt.name,
            "has_amax": self.has_amax,
            "amax_source": self.amax_source,
            "constant_amax": self.constant_amax,
        }

    def _check_extra_state(self, state: Any, where: str) -> None:
        if not isinstance(state, Mapping) or "format" not in state:
            raise RuntimeError(
                f"{where}: the saved extra state {state!r} is not a WireQuantizer's; load a "
                "state_dict saved from a moewire model"
            )
        if state["format"] != self.fmt.name:
            raise RuntimeError(
                f"{where}: the state_dict was saved from a {state['format']!r} quantizer, and "
                f"this one is {self.fmt.name!r}; build the model with the recipe it was "
                "calibrated with before loading"
            )

    def set_extra_state(self, state: Any) -> None:
        self._check_extra_state(state, self._label())
        has_amax = bool(state.get("has_amax", False))
        if has_amax:
            _host_amax(self.amax, f"{self._label()} (loaded state)")
        self.has_amax = has_amax
        self.amax_source = state.get("amax_source") if has_amax else None
        self.constant_amax = state.get("constant_amax")

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              *args: Any, **kwargs: Any) -> None:
        # Refuse a bad state before the amax buffer is overwritten: a refused load changes
        # nothing.
        where = prefix.rstrip(".") or self._label()
        extra = state_dict.get(prefix + "_extra_state")
        if extra is not None:
            self._check_extra_state(extra, where)
        amax = state_dict.get(prefix + "amax")
        if amax is not None:
            if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
                raise ValueError(
                    f"{where}: the saved amax is "
                    f"{amax.dtype if isinstance(amax, torch.Tensor) else type(amax).__name__}"
                    "; a WireQuantizer's amax is an FP32 [] tensor: load a state_dict saved "
                    "from a moewire model"
                )
            _host_amax(amax, f"{where} (loaded state)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> WireQuantizer:
        # model.to(torch.bfloat16) must move the state, never round the amax.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for key, old in before.items():
            new = self._buffers[key]
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[key] = old.to(new.device)
        return self

    # -- summary -----------------------------------------------------------------------

    def _label(self) -> str:
        return self.name or f"WireQuantizer({self.fmt.name})"

    def extra_repr(self) -> str:
        if self._mode == "disabled":
            return "disabled"
        parts = [self.fmt.name]
        if self._mode == "calibrate":
            parts.append("calibrating")
            if bool(self.calib_seen):
                parts.append(f"calib_amax={float(self.calib_amax):.4e}")
            else:
                parts.append("no data yet")
        elif self.has_amax:
            parts += [f"amax={float(self.amax):.4e}", str(self.amax_source)]
        elif self.fmt.needs_amax:
            parts.append("amax=dynamic" if self.allow_dynamic else "amax=None, needs calibration")
        return ", ".join(parts)
