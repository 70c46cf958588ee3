"""The ModelOpt quantizer moewire drives: :class:`WireTensorQuantizer`, a ``TensorQuantizer``
that keeps moewire's quantizer contract (``moewire.quantizer.WireQuantizerLike``), and the
quant backend :data:`BACKEND` that gives any ``TensorQuantizer`` moewire's math.

The math: ``fp8`` per tensor and ``nvfp4``, which moewire implements bit-exactly with
ModelOpt 0.47 (:data:`BIT_EXACT`), fake-quantize with moewire's format and fused kernels,
with the ``TensorQuantizer``'s amax; every other attribute set uses ModelOpt's math;
``backend_extra_args={"math": "modelopt" | "moewire"}`` overrides the choice.
``moewire.integrations.modelopt`` re-exports every public name.

Importing this module without ``nvidia-modelopt`` installed raises an ``ImportError`` that
says what to install.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:
    from modelopt.torch.quantization.calib import MaxCalibrator
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )
except ImportError as err:  # pragma: no cover - exercised only without modelopt
    raise ImportError(
        "moewire.integrations.modelopt needs nvidia-modelopt: "
        "pip install nvidia-modelopt==0.47.0 requests huggingface_hub "
        "(0.47.0 imports the last two without declaring them)"
    ) from err

from moewire import formats
from moewire.quantizer.config import USE_CONSTANT_AMAX, CfgError, parse_cfg
from moewire.quantizer.contract import calibration, max_all_reduce

__all__ = ["BACKEND", "BIT_EXACT", "WireTensorQuantizer", "format_name"]

#: Name of the ModelOpt quant backend moewire registers: ``{"backend": "moewire"}`` in a
#: quantizer cfg forces moewire's math on any ``TensorQuantizer`` of the model.
BACKEND = "moewire"

#: The formats whose moewire reference equals ModelOpt 0.47's fake quant bit for bit
#: (tests/modelopt/test_format_parity.py): moewire's math is the default for these only.
BIT_EXACT = ("fp8", "nvfp4")

_MATH_KEY = "math"
_MATHS = ("moewire", "modelopt")


def format_name(quantizer: TensorQuantizer) -> str | None:
    """The moewire format a ``TensorQuantizer``'s attributes spell, or ``None``.

    The spelling is moewire's own (``moewire.quantizer.parse_cfg``: ``num_bits``,
    ``block_sizes``, ``axis``), so the same cfg entry names the same format in ``mtq.quantize``
    and in ``moewire.quantize``. Integer, unsigned, per-channel and top-level dynamic
    quantizers return ``None``.
    """
    if quantizer._dynamic or quantizer._unsigned:
        return None
    cfg = {
        "num_bits": quantizer._num_bits,
        "block_sizes": quantizer._block_sizes,
        "axis": quantizer._axis,
    }
    try:
        return parse_cfg(cfg).fmt
    except CfgError:
        return None


def _math_of(quantizer: TensorQuantizer, where: str) -> str:
    """``"moewire"`` or ``"modelopt"``: who fake-quantizes for this quantizer."""
    asked = (quantizer.backend_extra_args or {}).get(_MATH_KEY)
    if quantizer.backend == BACKEND:
        asked = "moewire"
    if asked is not None and asked not in _MATHS:
        raise ValueError(
            f"{where}: backend_extra_args['{_MATH_KEY}'] is {asked!r}; use 'moewire' "
            "(moewire's bit-exact formats and kernels) or 'modelopt' (TensorQuantizer's math)"
        )
    mapped = format_name(quantizer)
    if asked is None:
        return "moewire" if mapped in BIT_EXACT else "modelopt"
    if asked == "moewire" and mapped is None:
        raise ValueError(
            f"{where}: moewire's math was asked for, but the quantizer attributes "
            f"(num_bits={quantizer._num_bits}, block_sizes={quantizer._block_sizes}, "
            f"axis={quantizer._axis}) name no moewire format (the table is in "
            "moewire.quantizer.parse_cfg); drop the request to use ModelOpt's math"
        )
    return asked


def _static_amax(quantizer: TensorQuantizer) -> torch.Tensor | None:
    """The fixed amax of a quantizer as FP32 ``[]`` on its device, or ``None``."""
    amax = getattr(quantizer, "_amax", None)
    if amax is None or quantizer._dynamic or amax.numel() != 1:
        return None
    return amax.detach().reshape(()).float()


def _moewire_qdq(inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
    """Fake quant with moewire's format and the quantizer's amax (the registered backend)."""
    _math_of(quantizer, f"ModelOpt backend {BACKEND!r}")  # refuses what moewire lacks
    amax = _static_amax(quantizer)
    if amax is None:
        # ModelOpt semantics for an uncalibrated per-tensor quantizer: the amax of this call.
        amax = inputs.detach().abs().amax().float()
    return formats.get(format_name(quantizer)).qdq(inputs, amax.to(inputs.device))


class WireTensorQuantizer(TensorQuantizer):
    """A ``TensorQuantizer`` that moewire's Mega-MoE wrapper can drive.

    It is a plain ModelOpt quantizer for everything ModelOpt does (cfg, calibration,
    summary, state); on top it implements the quantizer contract
    (``moewire.quantizer.WireQuantizerLike``) that ``moewire.quantizer.WireQuantizer``
    implements too, so the wrapper, ``moewire.calibrate`` and ``moewire.save_scales`` drive
    either. ``use_constant_amax`` (ModelOpt's KV-cache switch) pins the amax to 448.0, as
    ``constant_amax: 448.0`` does.

    Forward (``x``: BF16/FP16/FP32, any shape; returns ``x.dtype``, same shape): ModelOpt's
    ``TensorQuantizer.forward`` (disable, calibrate then pass through, quantize), where the
    fake quant itself is ``moewire.formats.get(fmt).qdq(x, amax)`` when :attr:`math` is
    ``"moewire"``, else ModelOpt's.
    """

    def set_from_attribute_config(self, attribute_cfg: Any) -> None:
        super().set_from_attribute_config(attribute_cfg)
        if self._use_constant_amax:
            # ModelOpt's math reads 448 for this switch without a buffer; moewire's reads the
            # amax buffer (it follows .to() and CUDA graphs), so pin it there, as
            # constant_amax does.
            self.amax = USE_CONSTANT_AMAX

    @property
    def math(self) -> str:
        """``"moewire"`` or ``"modelopt"`` (see the module docstring)."""
        return _math_of(self, type(self).__name__)

    @property
    def fmt(self) -> formats.WireFormat | None:
        """moewire's format when moewire's math runs this quantizer, else ``None``."""
        if self.math != "moewire":
            return None
        return formats.get(format_name(self))

    @property
    def mode(self) -> str:
        """``"disabled"``, ``"calibrate"`` (collect, pass through) or ``"quantize"``."""
        if self._disabled:
            return "disabled"
        if self._if_calib and not self._dynamic:
            return "calibrate"
        if self._if_quant:
            return "quantize"
        # ModelOpt turns quantization off for constant-amax quantizers while calibrating.
        return "disabled"

    @property
    def static_amax(self) -> torch.Tensor | None:
        """The fixed amax (calibrated, constant or loaded), FP32 ``[]``, or ``None``."""
        return _static_amax(self)

    @property
    def has_amax(self) -> bool:
        """Whether an amax is fixed (``static_amax is not None``)."""
        return self.static_amax is not None

    @property
    def constant_amax(self) -> float | None:
        """ModelOpt's ``constant_amax``, 448.0 for ``use_constant_amax``, else ``None``."""
        if self._use_constant_amax:
            return USE_CONSTANT_AMAX
        return None if self._constant_amax is None else float(self._constant_amax)

    @property
    def amax_source(self) -> str | None:
        """``"constant"`` for a pinned amax, else ``None``: ModelOpt does not record
        whether an amax was calibrated or loaded."""
        return "constant" if self.constant_amax is not None else None

    def is_static_scale(self) -> bool:
        """True when every scale of a row depends on the row alone (ModelOpt PR #2660).

        moewire's math: ``fmt.row_local and (not fmt.needs_amax or has_amax)``. ModelOpt's
        math: MX formats (per-32 block scales only), or any non-dynamic quantizer with a fixed
        amax; a per-call (dynamic) per-tensor amax is not.
        """
        fmt = self.fmt
        if fmt is not None:
            return fmt.row_local and (not fmt.needs_amax or self.has_amax)
        if self.is_mx_format:
            return True
        return not self._dynamic and self.has_amax

    def scale_amax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The amax the scale of ``x`` uses: ``None`` for a format without a global amax,
        the fixed one, else ``max|x|`` of this call (ModelOpt's uncalibrated behaviour)."""
        fmt = self.fmt
        if fmt is not None and not fmt.needs_amax:
            return None
        amax = self.static_amax
        if amax is None:
            return x.detach().abs().amax().float()
        return amax.to(x.device)

    def load_amax(self, amax: torch.Tensor | float) -> None:
        """Fix the amax (FP32 ``[]``), as ``moewire.load_scales`` does for its quantizers."""
        value = torch.as_tensor(amax, dtype=torch.float32).detach().reshape(())
        if getattr(self, "_amax", None) is not None:
            # A BF16 buffer left by calibration on BF16 data would round an FP32 value.
            self._amax = self._amax.float()
        self.amax = value

    def _fake_quantize(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.backend is None and self.math == "moewire":
            return self.fmt.qdq(inputs, self.scale_amax(inputs))
        return super()._fake_quantize(inputs)

    # -- calibration: the steps of moewire.quantizer.calibration ------------------------

    def collect(self, inputs: torch.Tensor) -> None:
        if inputs.numel() == 0:
            # A rank whose batch routed no row has seen a max of 0 (moewire's calibration
            # records the same), and must still take part in the EP max-reduce: ModelOpt's
            # max_calibrate refuses a group where some ranks have an amax and others none.
            inputs = inputs.new_zeros(1)
        super().collect(inputs)

    @property
    def calibratable(self) -> bool:
        """Whether calibration sets the amax: not dynamic, no pinned amax (as ModelOpt)."""
        return not self._dynamic and self.constant_amax is None

    def begin_calibration(self) -> None:
        """Forget the calibrator's max, then collect with quantization off (ModelOpt's flags).

        Raises:
            RuntimeError: already calibrating (calibration does not nest).
        """
        if self.mode == "calibrate":
            raise RuntimeError(
                f"{type(self).__name__}: already calibrating; calibrating() does not nest"
            )
        self._calibrator.reset()
        self.disable_quant()
        self.enable_calib()

    def end_calibration(self) -> None:
        """Quantize again, stop collecting."""
        self.enable_quant()
        self.disable_calib()

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[WireTensorQuantizer]:
        """Collect (values pass through) inside; load the max on exit
        (``moewire.quantizer.calibration`` for this quantizer alone)."""
        with calibration([(self, ())]):
            yield self

    def sync_amax(self, group: Any = None) -> None:
        """Max-all-reduce the calibrator's max and the fixed amax over a process group.

        Per tensor (a wire quantizer's amax): one collective per call whatever this rank
        holds (``moewire.quantizer.max_all_reduce``), so a rank that collected nothing
        neither hangs nor lowers the result, and gets the group's max. A per-channel amax
        (ModelOpt's math) is reduced in place, as ModelOpt's own sync does. No-op without
        an initialised group of > 1 ranks.
        """
        amax = getattr(self, "_amax", None)
        calib = (self._calibrator.compute_amax()
                 if isinstance(self._calibrator, MaxCalibrator) else None)
        present = [t for t in (calib, amax) if t is not None]
        if any(t.numel() != 1 for t in present):
            if torch.distributed.is_initialized():
                for t in present:
                    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
            return
        device = present[0].device if present else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.float32, device=device)
        reduced = max_all_reduce(
            group, device, zero if amax is None else amax, zero + (amax is not None),
            zero if calib is None else calib, zero + (calib is not None),
        )
        if reduced is None:
            return
        amax_max, any_amax, calib_max, any_calib = reduced
        if any_calib:
            like = zero if calib is None else calib
            self._calibrator._calib_amax = torch.full_like(like, calib_max)
        if any_amax:
            self.amax = torch.full_like(zero if amax is None else amax, amax_max)

    def load_calib_amax(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """Load the calibrator's max as the amax, FP32; ``None`` (amax kept) without data."""
        if not (args or kwargs) and self._calibrator.compute_amax() is None:
            return None
        super().load_calib_amax(*args, **kwargs)
        # The calibrator's max has the data's dtype (BF16); moewire keeps amax in FP32 (exact
        # for such a max), so kernels and CUDA graphs read the buffer itself, uncast.
        self._amax = self._amax.float()
        return self._amax


if not is_registered_quant_backend(BACKEND):
    register_quant_backend(BACKEND, _moewire_qdq)
