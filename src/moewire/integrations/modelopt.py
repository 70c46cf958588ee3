"""ModelOpt interop: moewire's dispatch/combine quantizers inside ``mtq.quantize``.

ModelOpt users configure quantizers by wildcard on their names, calibrate with
``mtq.quantize(model, cfg, forward_loop)``, read ``mtq.print_quant_summary(model)`` and save
``mto.modelopt_state(model)`` with the ``state_dict``. This module makes the Mega-MoE experts
modules part of that workflow (SPEC section 3):

- :func:`register` puts every experts class known to ``moewire.megamoe.registry`` (the
  stand-in, and vLLM's classes when vLLM is importable) into ModelOpt's
  ``QuantModuleRegistry``. ``mtq.quantize`` then converts each experts module (class swap)
  and its ``_setup`` creates two :class:`WireTensorQuantizer` children named
  ``dispatch_quantizer`` and ``combine_quantizer``: real ``TensorQuantizer`` objects, so the
  wildcards ``*dispatch_quantizer`` / ``*combine_quantizer`` match them, ``algorithm: max``
  calibrates them, the summary lists them and ``modelopt_state`` saves them.
- The math: a quantizer whose attributes name a format moewire implements bit-exactly
  (``fp8`` per tensor: ``num_bits=(4, 3)``; ``nvfp4``: ``num_bits=(2, 1)`` with
  ``block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}``) fake-quantizes with
  moewire's format (and its fused kernels), with the ``TensorQuantizer``'s amax. Any other
  attributes (INT8, MX, per-channel...), or ``backend_extra_args={"math": "modelopt"}``, use
  ModelOpt's own ``TensorQuantizer`` math.
- Scales interchange: :func:`to_modelopt_state` / :func:`from_modelopt_state` move amax
  values between moewire's quantizers and a ModelOpt-converted model.

Nothing here is imported by ``import moewire``; importing this module without
``nvidia-modelopt`` installed raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:
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

__all__ = ["BACKEND", "WireTensorQuantizer", "format_name"]

#: Name of the ModelOpt quant backend moewire registers: ``{"backend": "moewire"}`` in a
#: quantizer cfg forces moewire's math on any ``TensorQuantizer`` of the model.
BACKEND = "moewire"

_MATH_KEY = "math"
_MATHS = ("moewire", "modelopt")
_NVFP4_BLOCKS = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}


def format_name(quantizer: TensorQuantizer) -> str | None:
    """The moewire format a ``TensorQuantizer``'s attributes describe, or ``None``.

    Only formats whose moewire reference equals ModelOpt's fake quant bit for bit map
    (``docs/modelopt.md`` lists the checks):

    - ``"fp8"``: ``num_bits == (4, 3)``, no ``block_sizes``, ``axis is None`` (per tensor);
    - ``"nvfp4"``: ``num_bits == (2, 1)``, ``block_sizes == {-1: 16, "type": "dynamic",
      "scale_bits": (4, 3)}`` (the last-dim key may also be written as a positive index only
      by ModelOpt's own configs, which moewire does not accept: rows are the last dim).

    Integer, MX and per-channel attributes return ``None``: ModelOpt's math runs them.
    """
    num_bits = quantizer._num_bits
    blocks = quantizer._block_sizes
    if quantizer._dynamic or quantizer._unsigned:
        return None
    if num_bits == (4, 3) and blocks is None and quantizer._axis is None:
        return "fp8"
    if num_bits == (2, 1) and blocks is not None and dict(blocks) == _NVFP4_BLOCKS:
        return "nvfp4"
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
    if asked == "moewire" and mapped is None:
        raise ValueError(
            f"{where}: moewire's math was asked for, but the quantizer attributes "
            f"(num_bits={quantizer._num_bits}, block_sizes={quantizer._block_sizes}, "
            f"axis={quantizer._axis}) name no moewire format; moewire implements fp8 per "
            "tensor (num_bits=(4, 3)) and nvfp4 (num_bits=(2, 1), block_sizes={-1: 16, "
            "'type': 'dynamic', 'scale_bits': (4, 3)}); drop the backend to use ModelOpt's math"
        )
    if asked is None:
        return "moewire" if mapped is not None else "modelopt"
    return asked


def _static_amax(quantizer: TensorQuantizer) -> torch.Tensor | None:
    """The fixed amax of a quantizer as FP32 ``[]`` on its device, or ``None``."""
    if quantizer._use_constant_amax:
        return torch.tensor(448.0, dtype=torch.float32)
    amax = getattr(quantizer, "_amax", None)
    if amax is None or quantizer._dynamic or amax.numel() != 1:
        return None
    return amax.detach().reshape(()).float()


def _moewire_qdq(inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
    """Fake quant with moewire's format and the quantizer's amax (the registered backend)."""
    name = format_name(quantizer)
    if name is None:
        raise ValueError(
            f"ModelOpt backend {BACKEND!r}: quantizer attributes num_bits="
            f"{quantizer._num_bits}, block_sizes={quantizer._block_sizes}, axis="
            f"{quantizer._axis} name no moewire format (fp8 per tensor or nvfp4); remove "
            f"backend={BACKEND!r} from this quantizer's cfg"
        )
    amax = _static_amax(quantizer)
    if amax is None:
        # ModelOpt semantics for an uncalibrated per-tensor quantizer: the amax of this call.
        amax = inputs.detach().abs().amax().float()
    return formats.get(name).qdq(inputs, amax.to(inputs.device))


class WireTensorQuantizer(TensorQuantizer):
    """A ``TensorQuantizer`` that moewire's Mega-MoE wrapper can drive.

    It is a plain ModelOpt quantizer for everything ModelOpt does (cfg, calibration,
    summary, state); on top it exposes the surface ``moewire.quantizer.WireQuantizer``
    gives the wrapper: ``mode``, ``fmt``, ``static_amax``, ``has_amax``, ``is_static_scale``,
    ``scale_amax``, ``collect``, ``calibrating``, ``sync_amax``.

    Forward (``x``: BF16/FP16/FP32, any shape; returns ``x.dtype``, same shape): ModelOpt's
    ``TensorQuantizer.forward`` (disable, calibrate then pass through, quantize), where the
    fake quant itself is ``moewire.formats.get(fmt).qdq(x, amax)`` when :attr:`math` is
    ``"moewire"``, else ModelOpt's.
    """

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
        return self.static_amax is not None

    def is_static_scale(self) -> bool:
        """True when every scale of a row depends on the row alone (SPEC section 3).

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

    def scale_amax(self, x: torch.Tensor) -> torch.Tensor:
        """The amax the scale of ``x`` uses: the fixed one, else ``max|x|`` of this call."""
        amax = self.static_amax
        if amax is None:
            return x.detach().abs().amax().float()
        return amax.to(x.device)

    def _fake_quantize(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.backend is None and self.math == "moewire":
            return self.fmt.qdq(inputs, self.scale_amax(inputs))
        return super()._fake_quantize(inputs)

    def collect(self, inputs: torch.Tensor) -> None:
        # A rank whose batch routed no row to anything has nothing to add to the max.
        if inputs.numel() == 0:
            return
        super().collect(inputs)

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[WireTensorQuantizer]:
        """Collect (values pass through) inside; load the max on exit."""
        self.disable_quant()
        self.enable_calib()
        try:
            yield self
        finally:
            if self._calibrator.compute_amax() is not None:
                self.load_calib_amax()
            self.enable_quant()
            self.disable_calib()

    def sync_amax(self, group: Any = None) -> None:
        """Max-all-reduce the amax over a ``torch.distributed`` group (no-op without one)."""
        if getattr(self, "_amax", None) is None or not torch.distributed.is_initialized():
            return
        torch.distributed.all_reduce(self._amax, op=torch.distributed.ReduceOp.MAX, group=group)


if not is_registered_quant_backend(BACKEND):
    register_quant_backend(BACKEND, _moewire_qdq)
