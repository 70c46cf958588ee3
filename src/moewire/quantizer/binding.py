"""The wire quantizer bound to its format: :class:`WireQuantizer`.

:class:`WireQuantizer` is what the Mega-MoE wrapper puts on the dispatch and the combine
path. It resolves a format name or ModelOpt-style cfg (:meth:`~WireQuantizer.from_cfg`,
parsed by :func:`moewire.quantizer.config.parse_cfg`) to a :class:`~moewire.formats.WireFormat`,
picks the amax the format's scale uses (:meth:`~WireQuantizer.scale_amax`), runs the
format's math in ``forward`` / ``dequantize``, and saves and checks the format with the
state (``get_extra_state``, ``set_extra_state``, ``_load_from_state_dict``). Its state is
:class:`~moewire.quantizer.state.QuantizerState`'s, its calibration
:class:`~moewire.quantizer.calibrate.QuantizerCalibration`'s.

May import: torch, ``moewire.formats`` and the package's own ``config``, ``state`` and
``calibrate``; nothing else of moewire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from moewire import formats
from moewire.quantizer.calibrate import QuantizerCalibration
from moewire.quantizer.config import parse_cfg
from moewire.quantizer.contract import WireQuantizerModule
from moewire.quantizer.state import host_amax


class WireQuantizer(QuantizerCalibration):
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
        wire_format = formats.get(fmt)
        if accumulate is not None and accumulate not in formats.ACCUMULATE_MODES:
            raise ValueError(
                f"{label}: accumulate must be one of {formats.ACCUMULATE_MODES} (or None for "
                f"the format's own, {wire_format.combine_accumulate!r}), got {accumulate!r}"
            )
        super().__init__(wire_format, enable=enable, name=name)
        self.accumulate = accumulate or self.fmt.combine_accumulate
        self.allow_dynamic = allow_dynamic
        if constant_amax is not None:
            self.set_constant_amax(constant_amax)

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any], *, name: str | None = None) -> WireQuantizer:
        """Build a quantizer from a ModelOpt-style cfg dict (:func:`~.config.parse_cfg`).

        Raises:
            CfgError: (``ValueError``) the cfg cannot be mapped; the message names the key.
        """
        spec = parse_cfg(cfg)
        return cls(spec.fmt, constant_amax=spec.constant_amax, enable=spec.enable,
                   allow_dynamic=spec.allow_dynamic, name=name, accumulate=spec.accumulate)

    # -- the scale -----------------------------------------------------------------------

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

    # -- forward -------------------------------------------------------------------------

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

    # -- state_dict: the format travels with the amax ------------------------------------

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
            host_amax(self.amax, f"{self._label()} (loaded state)")
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
            host_amax(amax, f"{where} (loaded state)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- summary -----------------------------------------------------------------------

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


if TYPE_CHECKING:
    # The type checker proves here that WireQuantizer keeps the contract it is used through.
    _KEEPS_THE_CONTRACT: type[WireQuantizerModule] = WireQuantizer
